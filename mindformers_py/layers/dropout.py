"""Dropout whose random mask is cheap on the CPU.

torch's CPU dropout draws one Mersenne-Twister number per element (``bernoulli_``): on the 2-core benchmark machine
that was a quarter of a bf16 GPT step (69 of 283 ms, ``benchmarks/profile_step.py``). Here each 32-bit draw gives
two 15-bit uniform numbers, compared with a threshold, and the mask is applied by one multiplication forward and one
backward: the same distribution as torch's (keep probability rounded to 1/32768; the kept values scaled by the exact
inverse of that probability, rounded to the input's dtype as torch does) at about a third of the time. The random
numbers come from torch's default generator, so ``torch.manual_seed`` and saved RNG states reproduce a run.

Elsewhere (CUDA, whose Philox dropout is fast; DTensors, whose random ops follow the mesh; inside ``torch.compile``,
which generates its own) this is ``torch.nn.functional.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 15  # each 32-bit draw gives two 15-bit numbers


def _keep_mask(shape: torch.Size, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``1 / keep`` where an element is kept and 0 where it is dropped, in ``dtype``; P(kept) = keep."""
    numel = shape.numel()
    threshold = round(p * _LEVELS)
    # int32 random_() is uniform over [0, 2**31): the low 16 bits are uniform, the high 16 bits have a zero sign bit;
    # masking both halves to 15 bits gives two independent uniform numbers in [0, 2**15) per draw.
    draws = torch.empty((numel + 1) // 2, dtype=torch.int32).random_()
    numbers = draws.view(torch.int16)[:numel].bitwise_and_(_LEVELS - 1)
    mask = torch.empty(numel, dtype=dtype)
    torch.ge(numbers, threshold, out=mask)
    return mask.mul_(_LEVELS / (_LEVELS - threshold)).view(shape)


class _ScaleByMask(torch.autograd.Function):
    """``x * mask`` saving only the mask (the gradient is ``grad * mask``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def cheap_dropout_applies(x: torch.Tensor) -> bool:
    """Whether :func:`dropout` draws its own mask for ``x`` (a plain floating CPU tensor outside ``torch.compile``)."""
    return (x.device.type == "cpu" and type(x) is torch.Tensor and x.is_floating_point()
            and not torch.compiler.is_compiling())


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``torch.nn.functional.dropout(x, p, training)`` with a cheaper mask for plain CPU tensors."""
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0 or round(p * _LEVELS) == _LEVELS or not cheap_dropout_applies(x):
        return F.dropout(x, p, training)  # (p within 1/65536 of 1 would keep nothing at 15-bit resolution)
    return _ScaleByMask.apply(x, _keep_mask(x.shape, p, x.dtype))


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same attributes and ``p`` semantics) computed by :func:`dropout`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(input)
        return dropout(input, self.p, self.training)
