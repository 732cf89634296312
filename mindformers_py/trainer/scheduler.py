"""Learning-rate schedules from ``transformers.get_scheduler``, stepped by the Trainer."""

from __future__ import annotations

from typing import Any

import torch
from transformers import get_scheduler

from .arguments import TrainingArguments


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, max_steps: int) -> Any:
    """The ``args.lr_scheduler_type`` schedule over ``max_steps`` optimizer steps with the arguments' warmup."""
    return get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps_for(max_steps),
        num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )


def steps_on_metric(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on an evaluation metric (after ``evaluate``) rather than every optimizer step."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or type(scheduler).__name__ == "GreedyLR"

