"""Normalisation layers: LayerNorm (GPT-2, BERT, ViT) and RMSNorm (Llama, T5)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import check_choice

NORM_TYPES = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale.

    The statistics are computed in float32 and cast back, as Llama/T5 reference code does, so bf16 runs match
    HF checkpoints' numerics.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def build_norm(norm_type: str, hidden_size: int, eps: float, bias: bool = True) -> nn.Module:
    """Return the norm named by ``norm_type`` (``"layernorm"`` or ``"rmsnorm"``)."""
    check_choice("norm_type", norm_type, NORM_TYPES)
    if norm_type == "rmsnorm":
        return RMSNorm(hidden_size, eps=eps)
    return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
