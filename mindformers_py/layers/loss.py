"""Losses computed from logits, with HF's conventions (-100 ignored, ``num_items_in_batch`` normalisation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets of a causal LM: position t predicts ``labels[t + 1]``; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts ``labels[t + 1]``.

    Without ``num_items_in_batch`` it is the mean over non-ignored tokens; with it, the sum divided by that count,
    so gradient accumulation over micro-batches of unequal token counts equals one big batch.
    """
    targets = shift_labels(labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss
