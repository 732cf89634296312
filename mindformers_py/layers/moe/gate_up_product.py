"""The experts' gate and up projections as one grouped matrix product, without keeping the fused weight for backward.

One ``grouped_mm`` over ``[gate; up]`` side by side is faster than two over each (one pass over the rows, half the
per-expert calls), but the side-by-side copy is as large as both weights: (E, 2I, H), 0.75 GiB per layer of
Qwen3-30B-A3B's 128 experts in bf16. Left to autograd, ``grouped_mm`` saves that copy for the input's gradient, so
every MoE layer of a training step holds one until its backward (4 layers: +3 GiB on a 6 GiB model). This function
saves the two weights themselves (which are alive anyway) and rebuilds the copy in backward, where it is freed again
as soon as the input's gradient is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _GateUpProduct(torch.autograd.Function):
    """``tokens @ [gate; up]ᵀ`` per expert group, (R, H) -> (R, 2I), in ``dtype``."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, offsets: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(tokens, gate, up, offsets)
        ctx.dtype = dtype
        fused = torch.cat([gate, up], dim=1).to(dtype)
        return F.grouped_mm(tokens.to(dtype), fused.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tokens, gate, up, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_tokens = grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            fused = torch.cat([gate, up], dim=1).to(ctx.dtype)
            grad_tokens = F.grouped_mm(grad, fused, offs=offsets).to(tokens.dtype)
            del fused
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # (2I, R) @ (R, H) with the groups along R: each expert's (2I, H) weight gradient
            grad_fused = F.grouped_mm(grad.t(), tokens.to(ctx.dtype), offs=offsets)
            grad_gate, grad_up = (g.to(gate.dtype) for g in grad_fused.split(gate.shape[1], dim=1))
        return grad_tokens, grad_gate, grad_up, None, None


def gate_up_product(tokens: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, offsets: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """(R, H) rows grouped by expert (``offsets``: each group's end) through each expert's gate and up projections,
    (E, I, H) each -> (R, 2I): the gate's outputs, then the up projection's, in ``dtype``."""
    return _GateUpProduct.apply(tokens, gate, up, offsets, dtype)
