"""Which of a model's tensors a checkpoint fills, decided on names and shapes alone (before any value is read).

The rules are transformers': a checkpoint saved by a base model loads into a head model and the other way round; a
head the checkpoint lacks (a classifier on a pretrained LM) is initialised, another head's tensors in the checkpoint
are skipped; a tensor of another shape is refused unless ``ignore_mismatched_sizes`` (then initialised). A body
tensor the checkpoint lacks is initialised too, and one the model has no place for (a checkpoint of more layers
than the config asks, ``num_hidden_layers=1``) is skipped: both are reported in ``output_loading_info`` and in a
warning, as transformers does, unless they match ``_keys_to_ignore_on_load_missing`` /
``_keys_to_ignore_on_load_unexpected``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from torch import nn

from ..errors import MismatchedSizesError
from ..models.tied_weights import tied_keys

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadPlan:
    """What loading a checkpoint into a model does, tensor by tensor.

    Attributes:
        sources: model key -> the checkpoint key (after conversion) that fills it.
        missing: model keys the checkpoint lacks (initialised by the model's own init).
        mismatched: ``(key, checkpoint shape, model shape)`` of the tensors of another shape than the model's
            (initialised instead, by request).
        skipped: checkpoint keys the model has no place for (another head's, or layers the model does not have).
    """

    sources: dict[str, str]
    missing: list[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    skipped: list[str]

    def loading_info(self) -> dict[str, set | list]:
        """transformers' ``output_loading_info`` dict, in its types: sets of keys, mismatched ones as
        ``(key, checkpoint shape, model shape)``, and a list of error messages."""
        return {"missing_keys": set(self.missing), "unexpected_keys": set(self.skipped),
                "mismatched_keys": set(self.mismatched), "error_msgs": []}


def plan_load(model: nn.Module, shapes: dict[str, tuple[int, ...]], folder: str | Path,
              ignore_mismatched_sizes: bool = False) -> LoadPlan:
    """The :class:`LoadPlan` of a checkpoint whose (converted) tensors have ``shapes`` into ``model`` (any device,
    ``meta`` included). Raises the one-line errors of a checkpoint that does not fit the model."""
    prefix = f"{model.base_model_prefix}."
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    # checkpoint key (after re-prefixing) -> the converted key it was read under
    origin = {k: k for k in shapes}
    if not any(k.startswith(prefix) for k in origin):  # saved by a base model: its keys lack the prefix
        origin = {f"{prefix}{k}": v for k, v in origin.items()}
    is_base = not any(k.startswith(prefix) for k in expected)
    if is_base:
        origin = {k[len(prefix):]: v for k, v in origin.items() if k.startswith(prefix)}
    in_body = (lambda k: True) if is_base else (lambda k: k.startswith(prefix))
    for alias, source in tied_keys(model).items():
        if alias in expected and source in origin:
            origin[alias] = origin[source]
    mismatched = sorted(k for k, src in origin.items() if k in expected and tuple(shapes[src]) != expected[k])
    if mismatched and not ignore_mismatched_sizes:
        k = mismatched[0]
        raise MismatchedSizesError(f"weights in {folder} do not match the config: {k}: checkpoint "
                                   f"{tuple(shapes[origin[k]])} vs model {expected[k]} ({len(mismatched)} tensors "
                                   "differ); pass ignore_mismatched_sizes=True to re-initialise them")
    resized = [(k, tuple(shapes[origin[k]]), expected[k]) for k in mismatched]
    origin = {k: v for k, v in origin.items() if k not in mismatched}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in set(origin) - set(expected) if in_body(k) and not any(p.search(k) for p in ignored))
    optional = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing = sorted(k for k in set(expected) - set(origin) - set(mismatched) if not any(p.search(k) for p in optional))
    if missing:
        logger.warning("%s: %s not in %s, newly initialised; train it before use", type(model).__name__,
                       _listed(missing), folder)
    if unexpected:
        logger.warning("%s: %s in %s not used (the model has no such tensor)", type(model).__name__,
                       _listed(unexpected), folder)
    sources = {k: v for k, v in origin.items() if k in expected}
    skipped = sorted(k for k in set(origin) - set(expected) if not any(p.search(k) for p in ignored))
    return LoadPlan(sources=sources, missing=missing, mismatched=resized, skipped=skipped)


def _listed(keys: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``keys``, and how many more."""
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more
