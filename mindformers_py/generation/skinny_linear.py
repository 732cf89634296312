"""Faster GEMM formulations for the skinny products of CPU decoding, chosen by measuring them on this machine.

A decode step multiplies each weight matrix by only a few rows (one per sequence). ``F.linear`` computes
``x @ Wᵀ`` with ``W`` stored (out, in), and for such skinny products on CPU the BLAS path it takes is often far
from the memory-bandwidth bound. Two other formulations of the same product can be much faster, and which one wins
depends on the CPU and its BLAS:

* ``x @ Wt`` with a transposed copy ``Wt`` stored (in, out) (GPT-2's ``Conv1D`` layout);
* ``(W @ xᵀ)ᵀ`` on the weight as stored.

Measured with torch's MKL, fp32, one thread: on AMD EPYC, one row is about 1.6x faster as ``x @ Wt`` and 2-16 rows
about 1.8x faster as ``(W @ xᵀ)ᵀ``; on an Intel Sapphire Rapids, ``x @ Wt`` is 1.3-1.8x faster than ``F.linear`` for
1-16 rows while ``(W @ xᵀ)ᵀ`` is 3-4x *slower* for 4 rows. So the choice is measured, not assumed: the first time a
weight shape is decoded with a given row count, :func:`fastest_formulation` times the candidates on it and keeps the
winner for the process (a few milliseconds, once). The results are the same products, equal up to float rounding.

:func:`skinny_linear_kernels` switches a model's ``nn.Linear`` layers to their fastest formulation for the duration
of a block (the lean decode loop), then restores them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_SKINNY_ROWS = 16
"""Products with at most this many rows use a skinny formulation; larger ones (prefill) keep ``F.linear``."""

TRANSPOSED_COPY_BUDGET = 1 << 30
"""Most bytes of transposed weight copies made for decoding; bigger models do without ``x @ Wt``."""

MIN_STEPS_FOR_COPY = 16
"""The transposed copies are made only for at least this many steps: making them costs about what 10-15 steps
gain (measured as above), so shorter generations would lose more than they gain."""

LINEAR, WEIGHT_FIRST, TRANSPOSED = "linear", "weight_first", "transposed"
"""The formulations: ``F.linear``, ``(W @ xᵀ)ᵀ`` and ``x @ Wt``."""

# (out, in, rows, dtype, threads, copies allowed) -> the fastest formulation measured in this process.
_FASTEST: dict[tuple, str] = {}


def _product(formulation: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             weight_t: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` of few rows, in ``formulation``."""
    if formulation == TRANSPOSED:
        return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
    if formulation == WEIGHT_FIRST:  # (out, in) @ (in, rows), made contiguous so the ops downstream stay fast
        return (torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())).t().contiguous()
    return F.linear(x, weight, bias)


def fastest_formulation(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, allow_copy: bool) -> str:
    """The fastest of the formulations for products of ``rows`` rows with ``weight`` (``x @ Wt`` only when
    ``allow_copy``), timed once per shape, row count, dtype and thread count in this process."""
    key = (*weight.shape, rows, weight.dtype, torch.get_num_threads(), allow_copy)
    if key not in _FASTEST:
        # A private generator: drawing from the global one would change the tokens of a seeded sampling call.
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        weight_t = weight.t().contiguous() if allow_copy else None
        candidates = [LINEAR, WEIGHT_FIRST] + ([TRANSPOSED] if allow_copy else [])
        with torch.inference_mode():
            times = _interleaved_times({f: (lambda f=f: _product(f, x, weight, bias, weight_t)) for f in candidates})
        _FASTEST[key] = min(candidates, key=times.__getitem__)
    return _FASTEST[key]


def _interleaved_times(calls: dict[str, Callable[[], torch.Tensor]], rounds: int = 5,
                       round_seconds: float = 1e-3) -> dict[str, float]:
    """Best process CPU time per call of each candidate over ``rounds`` rounds that run every candidate in turn for
    about ``round_seconds`` (so a busy spell of a shared machine hits them alike). CPU time rather than wall time,
    so that other jobs do not decide the choice."""
    repeats = {}
    for name, call in calls.items():  # warm up, and size each candidate's share of a round
        call()
        start = time.perf_counter()
        call()
        repeats[name] = max(1, int(round_seconds / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.process_time()
            for _ in range(repeats[name]):
                call()
            best[name] = min(best[name], (time.process_time() - start) / repeats[name])
    return best


def _skinny_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_t: torch.Tensor | None,
                    rows: int, formulation: str) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, in ``formulation`` when ``x`` has the ``rows`` rows it was chosen for."""
    if x.numel() // x.shape[-1] != rows:
        return F.linear(x, weight, bias)
    y = _product(formulation, x.reshape(rows, x.shape[-1]), weight, bias, weight_t)
    return y.view(*x.shape[:-1], weight.shape[0])


def _eligible(module: nn.Module) -> bool:
    """A plain fp32 ``nn.Linear`` on CPU whose weight is an ordinary tensor (not a DTensor shard or a quantized one)."""
    if type(module) is not nn.Linear:
        return False
    weight = module.weight
    return (
        type(weight) is nn.Parameter
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and "forward" not in module.__dict__
    )


@contextlib.contextmanager
def skinny_linear_kernels(model: nn.Module, rows: int, steps: int = MIN_STEPS_FOR_COPY) -> Iterator[None]:
    """Within the block, the eligible ``nn.Linear`` layers of ``model`` compute products of ``rows`` rows in the
    formulation measured fastest for their shape (:func:`fastest_formulation`).

    Only CPU fp32 layers are switched (elsewhere the default kernels are already right). ``x @ Wt`` is a candidate
    only when the block will run at least :data:`MIN_STEPS_FOR_COPY` ``steps`` and the transposed copies take at most
    :data:`TRANSPOSED_COPY_BUDGET` bytes; the copies are made here and freed on exit. Nothing changes when ``rows``
    exceeds :data:`MAX_SKINNY_ROWS`, nor for layers where ``F.linear`` measured fastest.
    """
    layers = [m for m in model.modules() if _eligible(m)] if rows <= MAX_SKINNY_ROWS else []
    allow_copy = (
        steps >= MIN_STEPS_FOR_COPY
        and sum(m.weight.numel() * m.weight.element_size() for m in layers) <= TRANSPOSED_COPY_BUDGET
    )
    switched = []
    try:
        for module in layers:
            weight = module.weight.detach()
            bias = None if module.bias is None else module.bias.detach()
            formulation = fastest_formulation(weight, bias, rows, allow_copy)
            if formulation == LINEAR:
                continue
            weight_t = weight.t().contiguous() if formulation == TRANSPOSED else None
            # An instance attribute shadows nn.Linear.forward; hooks still run, since nn.Module.__call__ is untouched.
            module.forward = lambda x, w=weight, b=bias, wt=weight_t, f=formulation: _skinny_forward(x, w, b, wt, rows, f)
            switched.append(module)
        yield
    finally:
        for module in switched:
            module.__dict__.pop("forward", None)
