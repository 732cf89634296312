"""How a model's loss on one micro-batch becomes that micro-batch's share of the optimizer step's loss.

The step's loss is the sum of its items' losses divided by the items of the whole step (every micro-batch of the
gradient accumulation, every data-parallel rank): ``num_items_in_batch``, counted by the task registry (label
tokens, label entries, sequences, images). Then accumulation 1×8, 2×4 and 8×1 and any data-parallel split give one
big batch's gradients exactly. A model can return its loss in two ways:

* **normalised**: it divides by the ``num_items_in_batch`` it is given (our models, transformers' causal LMs): the
  loss already is the share;
* **mean**: it averages over its own micro-batch whatever it is given (transformers' sequence classifiers, T5):
  the share is ``mean × items in this micro-batch / num_items_in_batch``.

Which one a model does is read from its ``accepts_loss_kwargs`` attribute when it has one (transformers' own
convention), else measured once on the first labelled micro-batch: the loss with ``num_items_in_batch`` set to
twice the batch's items is half the plain loss for a normalising model and equal to it for a mean one.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

NORMALISED, MEAN, UNKNOWN = "normalised", "mean", "unknown"
# Rows of the first labelled micro-batch the probe runs on.
_PROBE_ROWS = 2


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether ``model.forward`` should be given ``num_items_in_batch`` (transformers' rule: the model's
    ``accepts_loss_kwargs`` when set, else whether ``forward`` takes ``**kwargs`` or that name)."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return flag
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "num_items_in_batch" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def initial_mode(model: nn.Module) -> str:
    """What is known before any batch: a declared ``accepts_loss_kwargs`` decides; otherwise a model that takes
    ``num_items_in_batch`` must be measured, and one that cannot take it averages."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return NORMALISED if flag else MEAN
    return UNKNOWN if accepts_loss_kwargs(model) else MEAN


def probe_mode(model: nn.Module, inputs: Mapping[str, Any], count_items: Callable[[Mapping[str, Any]], int | None]) -> str | None:
    """Measure whether ``model`` normalises by ``num_items_in_batch`` on (the first rows of) ``inputs``; None when
    the rows hold no item to measure with. Runs in eval mode without gradients and restores the mode."""
    sample = {k: v[:_PROBE_ROWS] if isinstance(v, torch.Tensor) and v.ndim >= 1 else v for k, v in inputs.items()}
    items = count_items(sample)
    if not items:
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = model(**sample).loss.float()
            given = model(**sample, num_items_in_batch=torch.tensor(2 * items)).loss.float()
    finally:
        model.train(was_training)
    if torch.allclose(given, plain / 2, rtol=1e-4, atol=1e-7):
        return NORMALISED
    if torch.allclose(given, plain, rtol=1e-4, atol=1e-7):
        return MEAN
    logger.warning("%s's loss neither divides by num_items_in_batch nor ignores it; gradient accumulation "
                   "averages its micro-batch losses as transformers' Trainer does", type(model).__name__)
    return UNKNOWN


def micro_batch_share(loss: torch.Tensor, mode: str, items: int | None, num_items_in_batch: Any,
                      accumulation: int) -> torch.Tensor:
    """A micro-batch's share of the step's loss from the model's ``loss`` in ``mode`` (see the module docstring).
    Without an item count (no labels, or an unmeasurable model) it is transformers' rule: the loss over the
    accumulation steps."""
    if num_items_in_batch is None or mode == UNKNOWN or (mode == MEAN and items is None):
        return loss / accumulation
    if mode == NORMALISED:
        return loss
    return loss * (items / num_items_in_batch)
