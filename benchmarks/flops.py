"""The two numbers a share-of-peak needs, measured here rather than taken from a data sheet.

:func:`matmul_peak` is the device's dense matrix-product rate in a dtype: the best of a few large square products
(the shapes BLAS and oneDNN reach their best on), with the thread count the caller uses. On a CPU with AMX or
AVX-512 BF16 the bf16 rate is several times the fp32 one. On a shared machine the best of several runs is the one
least disturbed by other jobs.

:func:`step_flops` counts the floating-point operations of one training step (forward and backward) of a model on
a batch with ``torch.utils.flop_counter``: matrix products, batched products and attention, as executed, whatever
the family. Element-wise work is not counted (the usual MFU convention).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
from torch.utils.flop_counter import FlopCounterMode


def matmul_peak(dtype: torch.dtype, device: str = "cpu", sizes: tuple[int, ...] = (1024, 2048, 3072),
                repeats: int = 3, budget_s: float = 1.0) -> float:
    """Best measured FLOP/s of ``n x n @ n x n`` products in ``dtype`` on ``device`` (each size run for about
    ``budget_s`` seconds, ``repeats`` times)."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm the kernels up
        for _ in range(repeats):
            calls, start = 0, _now(device)
            while True:
                a @ b
                calls += 1
                elapsed = _now(device) - start
                if elapsed >= budget_s / repeats or calls >= 200:
                    break
            best = max(best, 2 * n**3 * calls / elapsed)
    return best


def _now(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def step_flops(model: torch.nn.Module, batch: Mapping[str, Any]) -> int:
    """Matrix-product FLOPs of one forward + backward of ``model`` on ``batch`` (its ``.loss``); the gradients it
    makes are dropped."""
    was_training = model.training
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return counter.get_total_flops()
