"""One cast of a layer's input for the projections that share it under autocast.

Autocast casts a float32 input to the autocast dtype at every matrix product that takes it, and caches only the
casts of weights: an attention layer's query, key and value projections cast the same normed hidden states three
times forward and convert three gradients back. Casting once before them does the work once; what each projection
computes is unchanged (the same bf16 input and weights).
"""

from __future__ import annotations

import torch


def cast_for_autocast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for its device and ``x`` is float32; else ``x`` itself."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x
