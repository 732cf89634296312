"""Rows of a collated batch: how many it has, and its first ones (a rank's real samples before the padding a
rank without a share of a global batch reads; see :mod:`mindformers_py.trainer.batching`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_rows(batch: Mapping[str, Any]) -> int:
    """Rows of a collated batch (the first dimension of its first tensor with one)."""
    return next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), 0)


def first_rows(batch: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """``batch`` cut to its first ``rows`` rows (the tensors with its batch dimension; other values as they are)."""
    total = batch_rows(batch)
    if rows >= total:
        return dict(batch)
    return {k: v[:rows] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == total else v
            for k, v in batch.items()}
