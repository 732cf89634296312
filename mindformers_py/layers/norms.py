"""Normalisation layers: LayerNorm (GPT-2, BERT, ViT) and RMSNorm (Llama, T5)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import check_choice

NORM_TYPES = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale.

    The statistics are computed in float32 and cast back to the input's dtype, as Llama's reference code does, so
    bf16 runs match HF checkpoints' numerics; with ``cast_to_weight_dtype`` to the weight's dtype when it is half
    precision, else kept in float32 (T5's rule, which lets a float32 feed-forward output meet float16 layers).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, cast_to_weight_dtype: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.cast_to_weight_dtype = cast_to_weight_dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_to_weight_dtype:  # T5's rule: a half-precision norm returns its own dtype, else float32
            return self.weight * (x.to(self.weight.dtype) if self.weight.dtype in (torch.float16, torch.bfloat16) else x)
        return self.weight * x.to(dtype)

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
