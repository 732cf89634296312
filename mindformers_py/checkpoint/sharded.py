"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), and their consolidation.

A checkpoint folder holds:

* the DCP shards (``*.distcp``) and ``.metadata``: every rank writes only its own shards of the model and optimizer
  state, under the *unsharded* names (``model.layers.3.mlp.up_proj.weight``,
  ``state.model.layers.3.mlp.up_proj.weight.exp_avg``, ...) that ``get_state_dict`` gives for any layout;
* ``config.json``: the model config (with ``architectures``), so the folder can be consolidated on its own;
* ``extra_state.json``: small JSON values the caller passes (step counters, scheduler state).

Because names and global shapes do not depend on the layout, DCP reshards on load: a checkpoint written under
dp2 x tp2 loads under tp2, ZeRO-3 or stand-alone and training continues on the same loss curve.
:func:`consolidate_checkpoint` turns a folder into one ordinary safetensors checkpoint that
``AutoModelForCausalLM.from_pretrained`` loads (and ``convert_checkpoint(..., to="hf")`` exports to HF).

Consolidation builds a fresh model to load the shards into with a *model factory* given by the caller (as
torchtitan's checkpoint manager takes its state-dict adapter from the model spec): :func:`save_consolidated` uses the
class of the model it is given, :func:`consolidate_checkpoint` the class a folder's ``config.json`` names among the
model families (:func:`~mindformers_py.models.registry.model_class_named`), unless the caller passes its own.

Folders are written under a temporary name and renamed when every rank finished, so a crash never leaves a
half-written checkpoint under the final name.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..errors import CheckpointError
from ..parallel.tensor.adapters import is_peft_model
from ..utils.state_names import state_name
from .safetensors_io import atomic_folder
from .streamed_safetensors import DEFAULT_MAX_SHARD_SIZE, tensor_bytes

ModelFactory = Callable[[Path], nn.Module]
"""``factory(folder) -> model``: a fresh single-process model for the checkpoint ``folder`` (which holds the model's
``config.json``), into which consolidation loads the whole weights."""

MODEL_KEY, OPTIM_KEY = "model", "optimizer"
CONFIG_NAME, EXTRA_NAME, METADATA_NAME = "config.json", "extra_state.json", ".metadata"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A peft model's frozen base is not training state: it is rebuilt from its own checkpoint, so only the adapter is kept
# (and set back without the frozen tensors: DCP's load already requires every adapter tensor to be in the checkpoint).
_ADAPTER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _options(part: nn.Module) -> StateDictOptions:
    return _ADAPTER_OPTIONS if is_peft_model(part) else _OPTIONS


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _dcp_io(fn: Any, state: dict[str, Any], folder: Path, no_dist: bool | None = None,
            process_group: dist.ProcessGroup | None = None) -> None:
    """``dcp.save`` / ``dcp.load`` of ``state`` at ``folder`` (collective over ``process_group``, default: the whole
    job); without a process group (or with ``no_dist``) in this process alone."""
    no_dist = not dist.is_initialized() if no_dist is None else no_dist
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # no_dist is deliberate here
        fn(state, checkpoint_id=str(folder), no_dist=no_dist, process_group=None if no_dist else process_group)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, Sequence) and not isinstance(value, nn.Module) else [value]


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's inner optimizer over the parameters it owns (its
    state dict then names only those; DCP merges the ranks' parts), otherwise the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def training_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{"model": ..., "optimizer": ...}`` for DCP: flat, layout-independent names, local shards as DTensors.

    ``model`` may be a list of model parts (pipeline stages held by this rank), each with its own optimizer
    in ``optimizer`` (same order), or one optimizer when there is one part.
    """
    parts, optims = _as_list(model), _as_list(optimizer)
    if optims and len(optims) != len(parts):
        raise CheckpointError(f"got {len(parts)} model parts but {len(optims)} optimizers; pass one optimizer per part")
    state: dict[str, dict[str, Any]] = {MODEL_KEY: {}}
    if optims:
        state[OPTIM_KEY] = {}
    for i, part in enumerate(parts):
        if optims:
            model_sd, optim_sd = get_state_dict(part, _local_optimizer(optims[i]), options=_options(part))
            state[OPTIM_KEY].update(optim_sd)
        else:
            model_sd = get_model_state_dict(part, options=_options(part))
        if is_peft_model(part):  # torch keeps a frozen weight tied to another (a head tied to the embedding)
            frozen = _frozen_names(part)
            model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        state[MODEL_KEY].update(model_sd)
    return state


def _frozen_names(model: nn.Module) -> set[str]:
    """Names of ``model``'s parameters that do not train, in every place they are held (state-dict names)."""
    return {state_name(name) for name, param in
            model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def _architecture(model: nn.Module) -> str | None:
    """The model's own class name, skipping the classes FSDP/DDP/replicate insert in front of it."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.") and issubclass(cls, nn.Module):
            return cls.__name__
    return None


def _write_config(model: nn.Module, folder: Path) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    data = json.loads(config.to_json_string(use_diff=False))
    arch = _architecture(model)
    if arch and hasattr(model, "config_class"):  # a transformers-style model: its own class, as save_pretrained writes
        data["architectures"] = [arch]  # whatever a wrapped save_pretrained wrote before
    (folder / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True))


@contextlib.contextmanager
def shared_atomic_folder(final: Path, group: dist.ProcessGroup | None = None, manifest: bool = False,
                         needed_bytes: int | None = None) -> Iterator[Path]:
    """A temporary folder shared by all ranks of ``group`` (made by rank 0) that becomes ``final`` once every rank is
    done (:func:`~mindformers_py.checkpoint.safetensors_io.atomic_folder`: ``manifest`` written last by rank 0, a full
    disk reported naming ``final`` and ``needed_bytes``). A rank that fails while writing does not reach the last
    barrier, so the folder is never renamed: the others fail in that barrier (or its timeout)."""
    with contextlib.ExitStack() as stack:
        tmp = [str(stack.enter_context(atomic_folder(final, manifest=manifest, needed_bytes=needed_bytes)))
               if _is_rank0() else None]
        if dist.is_initialized():
            dist.broadcast_object_list(tmp, src=0, group=group)
        yield Path(tmp[0])
        _barrier(group)  # every rank has written its part before rank 0 renames the folder
    _barrier(group)


def save_checkpoint(
    folder: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a sharded checkpoint of ``model`` (and ``optimizer``) into ``folder``; collective (all ranks call it).

    ``extra`` is saved by rank 0 as JSON (step, scheduler state, ...) and returned by :func:`load_checkpoint`.
    Returns the folder.
    """
    final = Path(folder)
    state = training_state(model, optimizer)
    with shared_atomic_folder(final) as tmp:
        write_training_state(tmp, state, model, extra)
    return final


def write_training_state(folder: Path, state: dict[str, dict[str, Any]], model: nn.Module | Sequence[nn.Module],
                         extra: Mapping[str, Any] | None = None, process_group: dist.ProcessGroup | None = None) -> None:
    """Write ``state`` (:func:`training_state`, or a host copy of it taken earlier) as DCP shards into the existing
    ``folder``, with the model's ``config.json`` and ``extra`` (rank 0); collective over ``process_group``."""
    _dcp_io(dcp.save, state, folder, process_group=process_group)
    if _is_rank0():
        _write_config(_as_list(model)[0], folder)
        (folder / EXTRA_NAME).write_text(json.dumps(dict(extra or {}), indent=2))


def _check_folder(folder: Path) -> None:
    if not (folder / METADATA_NAME).is_file():
        what = "does not exist" if not folder.exists() else "is not a DCP checkpoint (no .metadata)"
        raise CheckpointError(f"checkpoint {folder} {what}; pass a folder written by save_checkpoint")


def load_checkpoint(
    folder: str | os.PathLike,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    no_dist: bool | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` under any layout into ``model`` (and ``optimizer``),
    resharding as needed; collective (``no_dist``: in this process alone, as a one-process run reads a distributed
    run's checkpoint). Returns the ``extra`` values saved with it.

    A tied weight a layout holds twice (a pipeline's last stage keeps its own copy of the embedding the first stage
    holds) is read, with its optimizer state, from the weight it is tied to when the checkpoint was written by a
    layout that held it once."""
    folder = Path(folder)
    _check_folder(folder)
    parts, optims = _as_list(model), _as_list(optimizer)
    state = training_state(parts, optims or None)
    aliases = _tied_aliases(parts, state, folder)
    for section, alias, source in aliases:
        state[section][source] = state[section].pop(alias)
    try:
        _dcp_io(dcp.load, state, folder, no_dist=no_dist)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]  # the exception of the first failing rank
        raise CheckpointError(f"checkpoint {folder} does not match the model/optimizer: {first}") from None
    for section, alias, source in aliases:
        state[section][alias] = state[section].pop(source)
    for i, part in enumerate(parts):
        if optims:
            set_state_dict(part, _local_optimizer(optims[i]), model_state_dict=state[MODEL_KEY],
                           optim_state_dict=state[OPTIM_KEY], options=_options(part))
            if isinstance(optims[i], ZeroRedundancyOptimizer):
                # ZeRO-1 copies its own param groups (lr, ...) into the inner optimizer at every step: give them the
                # loaded hyper-parameters, or the next step would run with the ones it was built with.
                _copy_hyper_parameters(optims[i].optim.param_groups, optims[i].param_groups)
        else:
            set_model_state_dict(part, state[MODEL_KEY], options=_options(part))
    extra_path = folder / EXTRA_NAME
    return json.loads(extra_path.read_text()) if extra_path.is_file() else {}


def _tied_aliases(parts: Sequence[nn.Module], state: dict[str, dict[str, Any]],
                  folder: Path) -> list[tuple[str, str, str]]:
    """``(section, key, source key)`` for each requested key of a tied weight (``_tied_weights_keys``: alias ->
    source) that the checkpoint lacks but holds under the source's name; this rank does not request the source
    itself (it holds one of the two)."""
    tied: dict[str, str] = {}
    for part in parts:
        keys = getattr(part, "_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            tied.update(keys)
    if not tied:
        return []
    stored = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    out = []
    for section, values in state.items():
        for key in list(values):
            if f"{section}.{key}" in stored:
                continue
            for alias, source in tied.items():
                renamed = _renamed_key(key, alias, source)
                if renamed is not None and renamed not in values and f"{section}.{renamed}" in stored:
                    out.append((section, key, renamed))
                    break
    return out


def _renamed_key(key: str, alias: str, source: str) -> str | None:
    """``key`` (a weight's name or a flattened optimizer key naming it: ``state.<name>.exp_avg``,
    ``param_groups.<name>.lr``) with the weight ``alias`` replaced by ``source``; None when it names another."""
    if key == alias:
        return source
    for prefix in ("state.", "param_groups."):
        if key.startswith(f"{prefix}{alias}."):
            return f"{prefix}{source}.{key[len(prefix) + len(alias) + 1:]}"
    return None


def _copy_hyper_parameters(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    for source, target in zip(src, dst):
        if source["params"]:  # an empty local group loaded nothing
            target.update({k: v for k, v in source.items() if k != "params"})


def model_from_config_file(folder: Path) -> nn.Module:
    """The default model factory of a checkpoint folder: a fresh model of the class its ``config.json`` names in
    ``architectures``, looked up among our model families, with that config."""
    from ..models.registry import model_class_named  # reads the family table (the built-in families load with it)

    data = json.loads((folder / CONFIG_NAME).read_text())
    arch = (data.get("architectures") or [None])[0]
    cls = model_class_named(arch) if arch else None
    if cls is None:
        raise CheckpointError(f"checkpoint {folder} names no model class of ours in {CONFIG_NAME} "
                              f"(architectures={data.get('architectures')!r}); pass model_factory= to build its model")
    return cls(cls.config_class.from_dict(data))


def consolidated_model(checkpoint_dir: str | os.PathLike, model_factory: ModelFactory | None = None) -> nn.Module:
    """A fresh single-process model holding the weights of a sharded checkpoint written under any layout; runs in
    one process without collectives. ``model_factory(folder)`` builds the model (default:
    :func:`model_from_config_file`, the class the checkpoint's ``config.json`` names)."""
    src = _model_folder(checkpoint_dir)
    model = (model_factory or model_from_config_file)(src)
    state = {MODEL_KEY: model.state_dict()}
    _dcp_io(dcp.load, state, src, no_dist=True)
    model.load_state_dict(state[MODEL_KEY])
    return model


def _model_folder(checkpoint_dir: str | os.PathLike) -> Path:
    src = Path(checkpoint_dir)
    _check_folder(src)
    if not (src / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"checkpoint {src} has no {CONFIG_NAME}; it cannot be consolidated without the model config"
        )
    return src


_FETCH_BYTES = 256 * 2**20
"""How many bytes of tensors one ``dcp.load`` call of a streamed consolidation reads at most (beside one tensor)."""


def write_consolidated(checkpoint_dir: str | os.PathLike, folder: str | os.PathLike,
                       model_factory: ModelFactory | None = None,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the whole weights of a sharded checkpoint into ``folder`` in ``save_pretrained`` format (safetensors,
    size-bounded shards with an index as transformers' ``max_shard_size``, config), in this process alone, without
    touching the random number generators. The weights stream: they are read from the shards a few at a time and
    written one tensor at a time, so the process never holds the whole model. ``model_factory`` as for
    :func:`consolidated_model` (built on ``meta``, for the config and the tensors' names only)."""
    from ..models.tied_weights import tied_keys
    from .streamed_safetensors import write_shards

    src = _model_folder(checkpoint_dir)
    with torch.device("meta"):
        model = (model_factory or model_from_config_file)(src)
    stored = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    tied = set(tied_keys(model))
    entries = []
    for key, value in model.state_dict().items():  # the order transformers saves in
        if key in tied or f"{MODEL_KEY}.{key}" not in stored:  # a tied alias (saved once), a buffer not saved
            continue
        entries.append((key, tuple(value.shape), value.dtype))
    cache: dict[str, torch.Tensor] = {}
    position = {name: i for i, (name, _, _) in enumerate(entries)}

    def fetch(key: str) -> torch.Tensor:
        if key not in cache:  # read this tensor and the next few with one dcp.load
            cache.clear()
            batch, size = {}, 0
            for name, shape, dtype in entries[position[key]:]:
                nbytes = tensor_bytes(shape, dtype)
                if batch and size + nbytes > _FETCH_BYTES:
                    break
                batch[name] = torch.empty(shape, dtype=dtype)
                size += nbytes
            _dcp_io(dcp.load, {MODEL_KEY: batch}, src, no_dist=True)
            cache.update(batch)
        return cache.pop(key)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_shards(folder, entries, fetch, max_shard_size)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records the class and the dtype
    model.config.dtype = next((dtype for _, _, dtype in entries if dtype.is_floating_point), model.config.dtype)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                           model_factory: ModelFactory | None = None,
                           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Turn a sharded checkpoint (any layout) into one safetensors checkpoint that
    ``mindformers_py.AutoModelForCausalLM.from_pretrained`` loads and ``convert_checkpoint(..., to="hf")``
    exports; runs in a single process (offline, or rank 0 of a job). ``output_dir`` is replaced, and appears
    under its final name only when complete. ``model_factory`` as for :func:`consolidated_model`."""
    with atomic_folder(output_dir) as tmp:
        write_consolidated(checkpoint_dir, tmp, model_factory, max_shard_size)
    return Path(output_dir)


def save_consolidated(model: nn.Module | Sequence[nn.Module], folder: str | os.PathLike,
                      processing_class: Any = None, model_factory: ModelFactory | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write whole weights (``save_pretrained`` format: safetensors + config) of a model trained under any layout
    into ``folder``, beside whatever it already holds; collective.

    The ranks write a sharded checkpoint of the weights into a temporary folder and rank 0 streams it into
    safetensors shards of at most ``max_shard_size`` (:func:`write_consolidated`), so pipeline stages on other ranks
    are included too and no rank ever holds the whole model. ``model_factory(folder)`` builds that model
    (default: a model of ``model``'s own class and config, :func:`same_class_factory`).
    """
    folder = Path(folder)
    holder = [tempfile.mkdtemp(prefix=".consolidate-", dir=_existing_parent(folder)) if _is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    tmp = Path(holder[0])
    try:
        _dcp_io(dcp.save, training_state(model), tmp)
        if _is_rank0():
            _write_config(_as_list(model)[0], tmp)
            folder.mkdir(parents=True, exist_ok=True)
            write_consolidated(tmp, folder, model_factory or same_class_factory(_as_list(model)[0]), max_shard_size)
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(folder)
        _barrier()
    finally:
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)


def same_class_factory(model: nn.Module) -> ModelFactory:
    """A factory of fresh models like ``model``: its own class (behind FSDP/DDP wrappers) with its config, for a
    transformers-style model (one with a ``config_class``); else the class a checkpoint's config names
    (:func:`model_from_config_file`)."""
    cls = next((c for c in type(model).__mro__ if c.__name__ == _architecture(model)), None)
    config = getattr(model, "config", None)
    if cls is None or not hasattr(cls, "config_class") or config is None:
        return model_from_config_file
    return lambda folder: cls(copy.deepcopy(config))


def _existing_parent(folder: Path) -> Path:
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent


# -- whole optimizer state in torch's own (index-keyed) format: stand-alone checkpoints resumed under a layout --


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any],
                              saved_names: Sequence[Sequence[str]] | None = None) -> None:
    """Load a whole, index-keyed optimizer state (a stand-alone run's ``optimizer.state_dict()``) into an optimizer
    of any layout; collective, every rank passes the same state.

    ``saved_names``: the names of the saved state's parameters, group by group in the order it numbers them (the
    whole model's: :func:`~mindformers_py.engine.optim.parameter_group_names`); each of this rank's parameters then
    takes its own state by name, so a layout holding only some of them (a pipeline stage, which may also lack a
    group) loads its part. A copy of a tied weight the whole model holds once (a pipeline's last stage's head)
    takes the state of the weight it is tied to. None: the groups must match this optimizer's one to one."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_state_dict(dict(state))
        return
    mine = get_optimizer_state_dict(model, optimizer)["param_groups"]
    saved_groups = state["param_groups"]
    if saved_names is None:
        saved_names = mine  # one to one: this run's names are the saved ones
        if len(mine) != len(saved_groups):
            raise CheckpointError(
                f"optimizer state has {len(saved_groups)} parameter groups; this run has {len(mine)}")
    else:
        saved_names = [{"params": list(group)} for group in saved_names]
        if len(saved_names) != len(saved_groups):
            raise CheckpointError(f"optimizer state has {len(saved_groups)} parameter groups; the model has "
                                  f"{len(saved_names)}")
    where: dict[str, tuple[int, int]] = {}  # name -> (saved group, saved index)
    for g, (names, saved) in enumerate(zip(saved_names, saved_groups)):
        if len(names["params"]) != len(saved["params"]):
            raise CheckpointError("optimizer state does not match the model: a parameter group has "
                                  f"{len(saved['params'])} parameters in the checkpoint, {len(names['params'])} here")
        where.update({name: (g, index) for name, index in zip(names["params"], saved["params"])})
    tied = _tied_sources(model)
    groups, values = [], {}
    for group in mine:
        found = [where.get(fqn) or where.get(tied.get(fqn, "")) for fqn in group["params"]]
        missing = next((fqn for fqn, f in zip(group["params"], found) if f is None), None)
        if missing is not None:
            raise CheckpointError(f"optimizer state does not match the model: no state for {missing} in the checkpoint")
        groups.append({**saved_groups[found[0][0]], "params": list(group["params"])})
        values.update({fqn: state["state"][index] for fqn, (_, index) in zip(group["params"], found)
                       if index in state["state"]})
    full = {"state": values, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def _tied_sources(model: nn.Module) -> dict[str, str]:
    """Tied weight name -> the name of the weight it is tied to (``_tied_weights_keys``), under ``model``'s names
    (a peft model's base model's keys carry its prefix)."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            prefix = f"{state_name(name)}." if name else ""
            out.update({prefix + alias: prefix + source for alias, source in keys.items()})
    return out
