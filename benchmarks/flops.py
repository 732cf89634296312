"""The two numbers a share-of-peak needs, measured here rather than taken from a data sheet.

:func:`matmul_peak` is the device's dense matrix-product rate in a dtype: the best of a few large square products
(the shapes BLAS and oneDNN reach their best on), with the thread count the caller uses. On a CPU with AMX or
AVX-512 BF16 the bf16 rate is several times the fp32 one. On a shared machine the best of several runs is the one
least disturbed by other jobs.

:func:`step_flops` counts the floating-point operations of one training step (forward and backward) of a model on
a batch with ``torch.utils.flop_counter``: matrix products, batched products and attention, as executed, whatever
the family. Element-wise work is not counted (the usual MFU convention).

:func:`products_alone_rate` answers how close to the peak a step *could* get: it records the matrix products of one
forward + backward (their shapes, strides and dtypes, as executed under autocast) and replays only them. Small
models multiply small matrices, which run far below the large-square peak; the replayed rate is the ceiling of a
step's share of the peak even if all other work (norms, activations, softmax, dropout, the optimizer) took no time.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
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


_PRODUCTS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
             torch.ops.aten.bmm.default: (0, 1), torch.ops.aten.baddbmm.default: (1, 2)}


class _RecordProducts(TorchDispatchMode):
    """Records (op, operand sizes and strides, dtype, FLOPs) of every dense matrix product executed under it."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            a, b = (args[i] for i in _PRODUCTS[func])
            flops = 2 * a.numel() * b.shape[-1]
            operands = [(t.shape, t.stride()) for t in args if isinstance(t, torch.Tensor)]
            self.products.append((func, operands, a.dtype, flops))
        return func(*args, **(kwargs or {}))


def products_alone_rate(model: torch.nn.Module, batch: Mapping[str, Any], dtype: torch.dtype,
                        repeats: int = 5) -> float:
    """FLOP/s of one forward + backward's matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) replayed alone on
    random operands of the same sizes, strides and dtypes; ``dtype`` bf16 runs the pass under CPU autocast."""
    was_training = model.training
    model.train()
    recorder = _RecordProducts()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), recorder:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    calls = [(func, [torch.empty_strided(size, stride, dtype=dt).normal_() for size, stride in operands])
             for func, operands, dt, _ in recorder.products]
    total = sum(flops for *_, flops in recorder.products)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms the kernels up
        start = time.perf_counter()
        for func, operands in calls:
            func(*operands)
        best = min(best, time.perf_counter() - start)
    return total / best
