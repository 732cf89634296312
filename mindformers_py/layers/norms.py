"""Normalisation layers: LayerNorm (GPT-2, BERT, ViT) and RMSNorm (Llama, T5)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import check_choice

NORM_TYPES = ("layernorm", "rmsnorm")


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's ``1 / sqrt(mean(x²) + eps)`` of the float32 ``x``, (..., 1)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """The reference computation (Llama's): statistics in float32, the normalised value cast to ``scale_dtype``
    before the scale."""
    x = hidden.float()
    return weight * (x * _inverse_rms(x, eps)).to(scale_dtype)


class _RMSNormFunction(torch.autograd.Function):
    """:func:`_rms_norm` with a hand-written backward: the same forward, op for op (so the same values), but it
    keeps only the input and the per-row inverse RMS for backward, where autograd keeps the float32 input, the
    normalised value and the cast copy too (in a bf16 run three times the input's bytes more), and its backward
    is six passes over the rows instead of autograd's ten (2.9% of a fp32 Qwen3 forward and backward on the CPU:
    ``docs/performance.md``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, eps: float, scale_dtype: torch.dtype) -> torch.Tensor:
        x = hidden.float()
        inv_rms = _inverse_rms(x, eps)
        ctx.save_for_backward(hidden, weight, inv_rms)
        ctx.eps, ctx.scale_dtype = eps, scale_dtype
        normed = (x * inv_rms).to(scale_dtype)
        if torch.result_type(normed, weight) == normed.dtype:
            return normed.mul_(weight)  # a fresh tensor: scaled in place (the same products as weight * normed)
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, inv_rms = ctx.saved_tensors
        wanted = [t for t, needed in zip((hidden, weight), ctx.needs_input_grad[:2]) if needed]
        if torch.is_grad_enabled():
            # create_graph=True (double backward: gradient penalties, Hessian-vector products): autograd's graph of
            # the reference ops, differentiable again.
            with torch.enable_grad():
                out = _rms_norm(hidden, weight, ctx.eps, ctx.scale_dtype)
            grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=True))
            return (next(grads) if ctx.needs_input_grad[0] else None,
                    next(grads) if ctx.needs_input_grad[1] else None, None, None)
        normed = hidden.float() * inv_rms
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(ctx.scale_dtype)).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # d/dx of x·r with r = rsqrt(mean(x²) + eps): r · (g - x·r · mean(g · x·r)), g the normalised value's
            # gradient (cast as autograd casts it: to the scale's dtype, then float32)
            g = (grad * weight).to(ctx.scale_dtype).float()
            dot = (g * normed).mean(-1, keepdim=True)
            grad_hidden = torch.addcmul(g, normed, dot, value=-1).mul_(inv_rms).to(hidden.dtype)
        return grad_hidden, grad_weight, None, None


def _hand_written_backward(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`_RMSNormFunction` applies: a backward will run, on plain tensors (a DTensor norm under
    sequence or tensor parallelism keeps autograd's ops, which DTensor shards), outside ``torch.compile`` (which
    fuses the reference ops itself), tracing and export."""
    return (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            and type(hidden) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale.

    The statistics are computed in float32 and cast back to the input's dtype, as Llama's reference code does, so
    bf16 runs match HF checkpoints' numerics; with ``cast_to_weight_dtype`` to the weight's dtype when it is half
    precision, else kept in float32 (T5's rule, which lets a float32 feed-forward output meet float16 layers).
    In training the backward is hand-written (:class:`_RMSNormFunction`): the same values, less kept, less work.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, cast_to_weight_dtype: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.cast_to_weight_dtype = cast_to_weight_dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.cast_to_weight_dtype:  # T5's rule: a half-precision norm returns its own dtype, else float32
            half = self.weight.dtype in (torch.float16, torch.bfloat16)
            scale_dtype = self.weight.dtype if half else torch.float32
        else:
            scale_dtype = hidden_states.dtype
        if _hand_written_backward(hidden_states, self.weight):
            return _RMSNormFunction.apply(hidden_states, self.weight, self.eps, scale_dtype)
        return _rms_norm(hidden_states, self.weight, self.eps, scale_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def build_norm(norm_type: str, hidden_size: int, eps: float, bias: bool = True,
               cast_to_weight_dtype: bool = False) -> nn.Module:
    """Return the norm named by ``norm_type`` (``"layernorm"`` or ``"rmsnorm"``; ``cast_to_weight_dtype``: see
    :class:`RMSNorm`)."""
    check_choice("norm_type", norm_type, NORM_TYPES)
    if norm_type == "rmsnorm":
        return RMSNorm(hidden_size, eps=eps, cast_to_weight_dtype=cast_to_weight_dtype)
    return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
