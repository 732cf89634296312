"""The loss of a training step, normalised in one place for every engine.

A step's loss is the sum of its items' losses divided by the items of the whole step (every micro-batch of the
gradient accumulation, every rank holding other samples): ``num_items_in_batch``, HF's name. Then accumulation
1×8, 2×4 and 8×1, any data-parallel split and any pipeline split give one big batch's gradients exactly. The path
is the same under every engine:

1. **count** the items of each of this rank's micro-batches (the task's rule: label tokens, label entries,
   sequences, images; :attr:`TrainingLoss.count_items`);
2. **sum the count** over the ranks that hold other samples of the step (:meth:`Engine.loss_group
   <mindformers_py.engine.base.Engine.loss_group>`: the data-parallel ranks), :func:`count_step_items`;
3. take each micro-batch's **share**: the loss function's value (the Trainer's ``compute_loss``, a user's override
   or ``compute_loss_func``) as it relates to ``num_items_in_batch`` (:func:`micro_batch_share`);
4. **rescale** for data parallelism: DDP and FSDP average gradients over the ranks of the loss group, so the value
   back-propagated is multiplied by their number (:class:`StepLoss`).

A stand-alone, distributed or pipeline engine differs only in where :class:`StepLoss` is called: on the whole
model for each micro-batch, or on the last pipeline stage for each pipeline micro-batch (where the "model" it
calls returns the outputs the stages computed, see
:class:`~mindformers_py.parallel.pipelining.schedule.LastStageModel`).

How a loss function's value relates to ``num_items_in_batch`` (its *mode*):

* **normalised**: it divides by the ``num_items_in_batch`` it is given (our models, transformers' causal LMs,
  ``compute_loss_func`` as transformers' Trainer takes it): the value already is the share;
* **mean**: it averages over its own micro-batch whatever it is given (transformers' sequence classifiers, T5):
  the share is ``mean × items in this micro-batch / num_items_in_batch``;
* **unknown**: neither can be relied on: the value is averaged over the step's micro-batches, transformers'
  rule without an item count.

A model's mode is read from its ``accepts_loss_kwargs`` attribute when it has one (transformers' own convention),
else measured once on the first labelled micro-batch (:func:`probe_mode`): the loss with ``num_items_in_batch``
set to twice the batch's items is half the plain loss for a normalising model and equal to it for a mean one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

NORMALISED, MEAN, UNKNOWN = "normalised", "mean", "unknown"
# Rows of the first labelled micro-batch the probe runs on.
_PROBE_ROWS = 2

LossFn = Callable[[nn.Module, dict[str, Any], Any], torch.Tensor]
"""``loss_fn(model, batch, num_items_in_batch)``: a micro-batch's share of the step's loss (a plain function: the
caller normalised it), or a :class:`TrainingLoss`, whose value :class:`StepLoss` turns into the share."""


@dataclass(frozen=True)
class TrainingLoss:
    """What the Trainer hands its engine: how a micro-batch's loss is computed and what it counts.

    ``compute(model, inputs, num_items_in_batch)`` is the Trainer's ``compute_loss`` (a user's override, or a
    ``compute_loss_func`` inside it); ``mode(inputs)`` says how that value relates to ``num_items_in_batch``
    (:data:`NORMALISED`, :data:`MEAN` or :data:`UNKNOWN`); ``count_items(batch)`` is the task's count of loss items
    (None without labels). ``override`` names a user's loss (``"compute_loss_func"``, ``"MyTrainer.compute_loss"``)
    so a layout that cannot run it can refuse it by name; None for the Trainer's own.
    """

    compute: LossFn
    count_items: Callable[[Mapping[str, Any]], int | None]
    mode: Callable[[Mapping[str, Any]], str]
    override: str | None = None

    def share(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any, pieces: int) -> torch.Tensor:
        """``inputs``' share of the step's loss; ``pieces`` is how many micro-batches the step's loss is spread
        over on this rank (what an unknown-mode loss is averaged over)."""
        loss = self.compute(model, inputs, num_items_in_batch)
        mode = self.mode(inputs)
        items = self.count_items(inputs) if mode == MEAN else None
        return micro_batch_share(loss, mode, items, num_items_in_batch, pieces)


class StepLoss:
    """The loss of one optimizer step under one engine: ``step(model, inputs)`` is the value a micro-batch
    back-propagates, its share of the step's loss times the data-parallel rescale.

    Args:
        loss_fn: a :class:`TrainingLoss`, or a plain :data:`LossFn` already returning the share.
        num_items_in_batch: the items of the whole step (:func:`count_step_items`), or None to average.
        pieces: the micro-batches this rank computes a loss on in the step (accumulation times pipeline
            micro-batches).
        ranks: the size of the loss group, whose gradient averaging the rescale undoes (applied only with a
            global item count: without one, the ranks' mean losses are averaged, as transformers does).
    """

    def __init__(self, loss_fn: LossFn | TrainingLoss, num_items_in_batch: Any, pieces: int, ranks: int) -> None:
        self.loss_fn = loss_fn
        self.num_items_in_batch = num_items_in_batch
        self.pieces = pieces
        self.scale = float(ranks) if num_items_in_batch is not None else 1.0

    def __call__(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if isinstance(self.loss_fn, TrainingLoss):
            loss = self.loss_fn.share(model, inputs, self.num_items_in_batch, self.pieces)
        else:
            loss = self.loss_fn(model, inputs, self.num_items_in_batch)
        return loss * self.scale if self.scale != 1.0 else loss


def count_step_items(loss: TrainingLoss, micro_batches: Sequence[Mapping[str, Any]], group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor | None:
    """Items of the whole step's loss (``num_items_in_batch``): this rank's micro-batches counted on the host and
    summed over ``group`` (the ranks holding other samples). None when a micro-batch has no labels or the loss
    cannot be rescaled exactly (then micro-batch losses are averaged, as transformers' Trainer does)."""
    counts = [loss.count_items(b) for b in micro_batches]
    if any(c is None for c in counts) or loss.mode(micro_batches[0]) == UNKNOWN:
        return None
    total = torch.tensor(sum(counts), device=device)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total


# -- how a loss function's value becomes a share ---------------------------------------------------------------


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
    """What is known of a model's loss before any batch: a declared ``accepts_loss_kwargs`` decides; otherwise a
    model that takes ``num_items_in_batch`` must be measured, and one that cannot take it averages."""
    flag = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(flag, bool):
        return NORMALISED if flag else MEAN
    return UNKNOWN if accepts_loss_kwargs(model) else MEAN


def probe_mode(model: nn.Module, inputs: Mapping[str, Any],
               count_items: Callable[[Mapping[str, Any]], int | None]) -> str | None:
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
                      pieces: int) -> torch.Tensor:
    """A micro-batch's share of the step's loss from a loss function's ``loss`` in ``mode`` (see the module
    docstring). Without an item count (no labels, or an unmeasurable model) it is transformers' rule: the loss
    over the step's ``pieces`` micro-batches."""
    if num_items_in_batch is None or mode == UNKNOWN or (mode == MEAN and items is None):
        return loss / pieces
    if mode == NORMALISED:
        return loss
    return loss * (items / num_items_in_batch)


__all__ = ["LossFn", "MEAN", "NORMALISED", "StepLoss", "TrainingLoss", "UNKNOWN", "accepts_loss_kwargs",
           "count_step_items", "initial_mode", "micro_batch_share", "probe_mode"]
