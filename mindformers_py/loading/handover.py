"""Handing a model over to worker processes without a whole copy per worker.

When the Trainer starts its own workers for a layout (:mod:`mindformers_py.trainer.local_workers`), its model goes to
them pickled. Its weights do not: each parameter is pickled as an empty ``meta`` parameter, and the model carries a
:class:`~.deferred.DeferredWeights` record saying where the values are, so each worker's layout fills only its own
shards (:func:`~.deferred.materialize`), reading them from memory-mapped files:

* a model loaded by ``from_pretrained`` and not changed since (no parameter replaced or written in place) points at
  the checkpoint it came from (and re-draws the inits of what it lacked, from the same seeds): nothing is written;
* any other model writes its weights once, tensor by tensor, into a folder the workers read.

Parameters added after loading (an adapter) are small and travel by value, as before.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any, Iterator

import cloudpickle
import torch
from torch import nn

from ..parallel.tensor.adapters import adapted_model
from ..checkpoint.streamed_safetensors import write_shards
from .deferred import NAME_ATTR, RECORD_ATTR, _holders, DeferredWeights, _param_names, meta_parameter, tag_module_names, \
    unchanged_record


class _ByReference(cloudpickle.CloudPickler):
    """cloudpickle, with the parameters named in ``by_reference`` sent as empty ``meta`` parameters."""

    def __init__(self, file: io.BytesIO, by_reference: set[int]) -> None:
        super().__init__(file)
        self.by_reference = by_reference

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in self.by_reference:
            return meta_parameter, (tuple(obj.shape), obj.dtype, obj.requires_grad)
        return super().reducer_override(obj)


@contextlib.contextmanager
def weights_by_reference(model: nn.Module, spill_folder: str | os.PathLike) -> Iterator[set[int]]:
    """While the block runs, ``model`` (a model of ours, or a peft model around one) carries the record its weights
    can be rebuilt from elsewhere, its weights written to ``spill_folder`` first if no checkpoint holds them; yields
    the ids of the parameters to send by reference (for :func:`dumps`). A model that is not ours yields nothing."""
    base = adapted_model(model)
    if not hasattr(base, "config") or not isinstance(base, nn.Module):
        yield set()
        return
    record = unchanged_record(base)
    if record is None:
        tag_module_names(base)  # (kept: the names of the modules in the model as it is now)
    params = {name: param for name, _, _, param in _param_names(base)}
    if record is None:
        folder = Path(spill_folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_shards(folder, [(name, tuple(p.shape), p.dtype) for name, p in params.items()],
                     lambda name: params[name].detach(), max_shard_size="2GB")
        sources = {name: name for name in params}
        for group in _holders(base):  # a tied weight is written once; its other places read it from there
            owner = _qualified(*group[0])
            sources.update({_qualified(module, attr): owner for module, attr in group[1:]})
        record = DeferredWeights(folder=str(folder), from_hf=False, sources=sources, seed=0)
    before = base.__dict__.get(RECORD_ATTR)
    base.__dict__[RECORD_ATTR] = record
    try:
        yield {id(p) for p in params.values()}
    finally:
        if before is None:
            base.__dict__.pop(RECORD_ATTR, None)
        else:
            base.__dict__[RECORD_ATTR] = before


def _qualified(module: nn.Module, attr: str) -> str:
    prefix = module.__dict__[NAME_ATTR]
    return f"{prefix}.{attr}" if prefix else attr


def dumps(obj: Any, by_reference: set[int]) -> bytes:
    """``cloudpickle.dumps(obj)`` with the parameters ``by_reference`` as empty ``meta`` parameters."""
    buffer = io.BytesIO()
    _ByReference(buffer, by_reference).dump(obj)
    return buffer.getvalue()

