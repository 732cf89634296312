"""The optimizer an engine builds: AdamW over decay / no-decay parameter groups with the run's hyper-parameters."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..errors import MindFormersError
from ..utils.state_names import state_name
from .args import EngineArguments

# Devices whose AdamW has a fused kernel in torch.
_FUSED_DEVICES = ("cuda", "cpu", "mps", "xpu")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into a decayed group (matrices, embeddings) and a group without decay (biases
    and normalisation weights, i.e. every parameter with fewer than two dimensions). Tied parameters appear once."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def parameter_group_names(model: nn.Module) -> list[list[str]]:
    """The names of :func:`parameter_groups`' parameters, group by group: the order in which a stand-alone
    optimizer's state (``optimizer.state_dict()``) numbers them, so a layout holding only some of them (a pipeline
    stage) finds its own in it."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(state_name(name))
    return [g for g in (decay, no_decay) if g]


def create_optimizer(groups: Iterable[dict[str, Any]], args: EngineArguments) -> torch.optim.Optimizer:
    """AdamW over ``groups`` with the arguments' hyper-parameters, fused or foreach as ``args.optim`` asks."""
    groups = list(groups)
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise MindFormersError("the model has no trainable parameters (every parameter has requires_grad=False)")
    fused = args.optim == "adamw_torch_fused" and all(
        p.device.type in _FUSED_DEVICES and p.is_floating_point() for p in params
    )
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        weight_decay=args.weight_decay, **kwargs,
    )
