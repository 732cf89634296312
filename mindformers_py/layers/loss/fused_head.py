"""A causal LM's head fused with its loss inside the model's own forward (``TrainingArguments.fused_loss``).

Within :func:`loss_without_logits`, a model that supports it (an attribute ``fuse_loss_with_head``: the GPT
family's causal LM) called with labels computes its next-token loss with
:func:`~mindformers_py.layers.loss.linear_cross_entropy.linear_cross_entropy` and returns no logits, so the
(tokens x vocabulary) logits, their fp32 copy and their gradient never exist. Because the model is still called
whole, this works where a loss computed from outside the model cannot: under FSDP2 / replicate, whose hooks live on
the modules they wrap, and on every data-, expert- and context-parallel rank.

A frozen head that ZeRO-2/3 shards as an FSDP2 unit of its own is gathered for the loss alone (:func:`head_weights`)
and sharded again as soon as it returns: the loss makes its gradients in its forward, so backward needs no weight,
where the unfused head stays gathered from its forward to its backward and its logits are made whole besides. A head
tensor parallelism shards over the vocabulary (rows split over a 1-D mesh, no bias) runs the loss
vocabulary-parallel, as ``loss_parallel`` does for its logits: each rank's chunk of logits covers its rows only.
A frozen head split by rows over the data-parallel ranks (``ParallelConfig.shard_frozen_head``) scores every
rank's tokens against each rank's rows, the hidden states gathered over those ranks. A head trained while FSDP2
shards it (its module's hooks, which reduce the weight's gradient, do not run when its
forward is skipped) or sharded otherwise keeps the model's own loss; :func:`fusable_head` says which.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .linear_cross_entropy import linear_cross_entropy, vocab_parallel_linear_cross_entropy

FLAG = "fuse_loss_with_head"
"""The attribute a model sets (False) to say it can fuse its head with its loss; :func:`loss_without_logits` sets it
True for the duration of a call."""
TAKEN = "fused_loss_taken"
"""The attribute such a model sets after each call with labels under the flag: whether its head was fused."""
SEQUENCE_SHARDED_INPUT = "vocab_parallel_input_sharded"
"""The attribute tensor parallelism sets on a head it shards over the vocabulary: True when the head's input is this
rank's part of the sequence (sequence parallelism), False when it is the whole sequence."""
ROWS_OVER_BATCH = "vocab_rows_over_batch"
"""The attribute (True) on a frozen head whose rows are split over the data-parallel ranks, which hold different
tokens (``ParallelConfig.shard_frozen_head``: :func:`mindformers_py.parallel.frozen_head.shard_frozen_head`)."""


def fusable_head(head: nn.Module | None) -> bool:
    """Whether ``head`` can be folded into the loss: an ``nn.Linear`` (not a peft adapter over one) whose weight is
    a whole local tensor, or becomes one when FSDP2 gathers it. A head FSDP2 wraps as a unit of its own qualifies
    only when frozen: its module's hooks, which reduce a trained weight's gradient, do not run when its forward is
    skipped."""
    if not isinstance(head, nn.Linear):
        return False
    if _rows_over_batch(head):
        return not head.weight.requires_grad
    if isinstance(head, FSDPModule):
        return not head.weight.requires_grad and _gathers_whole(head)
    if isinstance(head.weight, DTensor) and not _vocabulary_parallel(head):
        return False
    return type(head) is nn.Linear or not head.weight.requires_grad


def _vocabulary_parallel(head: nn.Linear) -> bool:
    """Whether tensor parallelism shards ``head`` over the vocabulary alone: rows split over a 1-D mesh, no bias."""
    weight = head.weight
    return (isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)
            and head.bias is None and hasattr(head, SEQUENCE_SHARDED_INPUT))


def _rows_over_batch(head: nn.Linear) -> bool:
    """Whether ``head``'s frozen rows are split over the data-parallel ranks (:data:`ROWS_OVER_BATCH`)."""
    return bool(getattr(head, ROWS_OVER_BATCH, False)) and isinstance(head.weight, DTensor)


def fused_head_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor,
                    num_items_in_batch: int | torch.Tensor | None = None, shift: bool = True) -> torch.Tensor:
    """The next-token loss of ``head`` (one :func:`fusable_head` allows) over ``hidden``, without logits:
    vocabulary-parallel for a head tensor parallelism shards, every data-parallel rank's tokens against each rank's
    rows for a head split over them, else on the whole weight (:func:`head_weights`)."""
    if _rows_over_batch(head):
        return vocab_parallel_linear_cross_entropy(hidden, head.weight, labels, num_items_in_batch, shift,
                                                   gather_tokens=True)
    if _vocabulary_parallel(head) and not isinstance(head, FSDPModule):
        return vocab_parallel_linear_cross_entropy(hidden, head.weight, labels, num_items_in_batch, shift,
                                                   getattr(head, SEQUENCE_SHARDED_INPUT))
    with head_weights(head) as (weight, bias):
        return linear_cross_entropy(hidden, weight, labels, num_items_in_batch, bias, shift=shift)


def _gathers_whole(head: FSDPModule) -> bool:
    """Whether FSDP2's gather of ``head`` gives whole local tensors (no tensor-parallel DTensor under its shards)."""
    groups = head._get_fsdp_state()._fsdp_param_groups  # (torch exposes no public view of a unit's parameters)
    return all(not param.is_dtensor for group in groups for param in group.fsdp_params)


@contextmanager
def head_weights(head: nn.Linear) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``head``'s weight and bias as whole local tensors, for the length of one fused loss. A head FSDP2 shards as
    a unit of its own is gathered (its ``unshard``) and sharded again on the way out (``reshard``): the fused loss
    keeps no weight for backward, so the gathered head lives for the loss alone, not from forward to backward."""
    if not isinstance(head, FSDPModule):
        yield head.weight, head.bias
        return
    head.unshard()
    try:
        yield head.weight, head.bias
    finally:
        head.reshard()


def fusing_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of ``model`` (itself included) that can fuse their head with their loss."""
    return [m for m in model.modules() if hasattr(m, FLAG)]


@contextmanager
def loss_without_logits(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Within, every module of :func:`fusing_modules` computes its loss with labels from its hidden states and head
    weight directly and returns ``logits=None``; yields those modules (their :data:`TAKEN` says afterwards
    whether each one did)."""
    modules = fusing_modules(model)
    for module in modules:
        setattr(module, FLAG, True)
    try:
        yield modules
    finally:
        for module in modules:
            setattr(module, FLAG, False)


__all__ = ["FLAG", "ROWS_OVER_BATCH", "SEQUENCE_SHARDED_INPUT", "TAKEN", "fusable_head", "fused_head_loss",
           "fusing_modules", "head_weights", "loss_without_logits"]
