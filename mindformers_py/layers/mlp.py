"""Feed-forward blocks: the classic two-layer MLP (GPT-2, BERT, ViT) and the gated SwiGLU MLP (Llama family).

Tensor parallel: ``gate_proj``/``up_proj`` are ``colwise``, ``down_proj`` ``rowwise``; the elementwise work in
between is local to each shard, so no communication happens inside the block. MoE experts reuse this class.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..errors import check_choice
from .autocast_input import cast_for_autocast
from .dropout import Dropout


_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


class MLP(nn.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when ``gated`` (SwiGLU with ``act="silu"``); with
    ``dropout`` > 0, dropout on the hidden activations before ``down`` (T5's feed-forward)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "gelu_new", gated: bool = False, bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = Dropout(dropout) if dropout > 0 else None
        check_choice("hidden_act", act, sorted(ACT2FN.keys()))
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # GPT-2's tanh-approximated GELU spelled as one fused op (HF's module computes it in seven).
        self.act = functools.partial(F.gelu, approximate="tanh") if act in _TANH_GELU else ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            x = cast_for_autocast(x)  # one cast for the two projections that read it
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.act(self.up_proj(x))
        if self.dropout is not None and self.training:
            h = self.dropout(h)
        if (h.dtype != self.down_proj.weight.dtype and self.down_proj.weight.is_floating_point()
                and not torch.is_autocast_enabled(h.device.type)):
            # a projection kept in float32 in a reduced-precision model (T5's _keep_in_fp32_modules); under
            # autocast the product casts to the autocast dtype anyway, and converting here cost two copies each way
            h = h.to(self.down_proj.weight.dtype)
        return self.down_proj(h)
