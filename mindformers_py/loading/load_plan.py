"""Which of a model's tensors a checkpoint fills, decided on names and shapes alone (before any value is read).

The checks are transformers' (and were ours when the whole state dict was loaded): a checkpoint saved by a base
model loads into a head model and the other way round; a head the checkpoint lacks (a classifier on a pretrained
LM) is initialised, another head's tensors in the checkpoint are skipped; a tensor of another shape is refused unless
``ignore_mismatched_sizes`` (then initialised); tensors matching ``_keys_to_ignore_on_load_unexpected`` are skipped
and body tensors matching ``_keys_to_ignore_on_load_missing`` are initialised like a new head.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from torch import nn

from ..errors import CheckpointError, MismatchedSizesError
from ..models.tied_weights import tied_keys

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadPlan:
    """What loading a checkpoint into a model does, tensor by tensor.

    Attributes:
        sources: model key -> the checkpoint key (after conversion) that fills it.
        missing: model keys the checkpoint lacks (initialised by the model's own init).
        mismatched: checkpoint keys of another shape than the model's (initialised instead, by request).
        skipped: checkpoint keys the model has no place for (another head's).
    """

    sources: dict[str, str]
    missing: list[str]
    mismatched: list[str]
    skipped: list[str]

    def loading_info(self) -> dict[str, list]:
        """transformers' ``output_loading_info`` dict."""
        return {"missing_keys": list(self.missing), "unexpected_keys": list(self.skipped),
                "mismatched_keys": list(self.mismatched), "error_msgs": []}


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
    origin = {k: v for k, v in origin.items() if k not in mismatched}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(k for k in set(origin) - set(expected) if in_body(k) and not any(p.search(k) for p in ignored))
    missing = sorted(set(expected) - set(origin))
    optional = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing_body = [k for k in missing if in_body(k) and k not in mismatched and not any(p.search(k) for p in optional)]
    if missing_body:
        raise CheckpointError(f"weights in {folder} do not match the config: missing {missing_body[0]} "
                              f"({len(missing_body)} tensors missing)")
    if unexpected:
        raise CheckpointError(f"weights in {folder} do not match the config: unexpected {unexpected[0]} "
                              f"({len(unexpected)} extra tensors)")
    if missing:
        logger.warning("%s: %s not in %s, newly initialised; train it before use", type(model).__name__,
                       ", ".join(missing), folder)
    sources = {k: v for k, v in origin.items() if k in expected}
    skipped = sorted(set(origin) - set(expected))
    return LoadPlan(sources=sources, missing=missing, mismatched=mismatched, skipped=skipped)
