"""How many parameters an adapter trains, counted by peft itself on the model built without memory (the meta device),
so the planner can size gradients and optimizer state for the adapter alone."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..errors import ConfigError


def adapter_parameter_count(peft_config: Any, model_config: Any, task: str = "causal_lm") -> int:
    """Trainable parameters once ``peft_config`` (a peft config or a ``peft:`` section) wraps the ``task`` model of
    ``model_config``: the model is built on the meta device (no weights allocated) and wrapped by peft."""
    from ..auto import auto_class_for
    from .apply import apply_peft

    auto = auto_class_for(task)
    with torch.device("meta"):
        model = auto.from_config(copy.deepcopy(model_config))
        wrapped = apply_peft(model, copy.deepcopy(peft_config), task=task)  # peft fills in its config
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    if trainable == 0:
        raise ConfigError("the peft section trains no parameter of the model; check its target_modules")
    return trainable
