"""The files of a stand-alone checkpoint besides the weights (optimizer, scheduler, fp16 scaler, RNG states), and
checked loading of weights and of those files: a missing or damaged file is a one-line CheckpointError naming it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import CheckpointError

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_NAME = "rng_state.pth"
DCP_DIR = "dcp"
"""The sharded (torch.distributed.checkpoint) part of a distributed run's checkpoint, which any layout resumes."""


def copy_weights(model: nn.Module, state: Mapping[str, torch.Tensor], where: str | Path) -> None:
    """Copy ``state`` into ``model``'s parameters and buffers, checking names and shapes. A key may be missing
    only when it is tied to (shares its tensor with) a key that is present, as ``save_pretrained`` drops ties."""
    expected = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, tensor in expected.items():
        aliases[id(tensor)].append(name)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"weights in {where} do not match the model: unexpected {unexpected[0]} "
                              f"({len(unexpected)} extra tensors)")
    missing = [n for n in expected if n not in state and not any(a in state for a in aliases[id(expected[n])])]
    if missing:
        raise CheckpointError(f"weights in {where} do not match the model: missing {missing[0]} "
                              f"({len(missing)} tensors missing)")
    with torch.no_grad():
        for name, value in state.items():
            target = expected[name]
            if target.shape != value.shape:
                raise CheckpointError(f"weights in {where} do not match the model: {name} has shape "
                                      f"{tuple(value.shape)} in the checkpoint, {tuple(target.shape)} in the model")
            target.copy_(value)


def torch_load(path: Path, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent} is incomplete: {what} file {path.name} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling raises many types; all mean a damaged file
        raise CheckpointError(f"{what} file {path} is damaged ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else 'unreadable'})") from None


def load_state_into(what: str, target: Any, path: Path) -> None:
    state = torch_load(path, what)
    if what == "scheduler":
        state = _fit_scheduler_groups(state, target)
    try:
        target.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError, TypeError) as err:
        raise CheckpointError(f"{what} state in {path} does not match this run ({err})") from None


def _fit_scheduler_groups(state: dict[str, Any], scheduler: Any) -> dict[str, Any]:
    """A learning-rate scheduler's state with its per-parameter-group lists (base rates, last rates, lambdas) fitted
    to this run's optimizer, when every group of the saved run had the same entry: a layout may hold another number
    of the same groups (a pipeline stage with only the adapter's matrices has no group without weight decay)."""
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None:
        return state
    groups = len(optimizer.param_groups)
    fitted = dict(state)
    for key, value in state.items():
        if isinstance(value, list) and value and len(value) != groups and all(v == value[0] for v in value):
            fitted[key] = [value[0]] * groups
    return fitted
