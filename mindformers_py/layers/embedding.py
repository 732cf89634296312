"""Position encodings: learned absolute positions (GPT-2, BERT, ViT; RoBERTa's padding-aware numbering) and rotary
embeddings (Llama family); the norm + dropout of summed embeddings (BERT).

Token embeddings are plain ``nn.Embedding`` modules owned by each model; their tensor-parallel style
(``embedding_rowwise``, i.e. vocabulary-sharded) is declared in the model's plan, not here. Where transformers builds
a table with ``padding_idx`` (Llama-flavoured token tables, BERT's, RoBERTa's positions), ours has it too: that row
starts at zero and gets no gradient, so the padding token never learns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .dropout import Dropout
from .norms import build_norm


class LearnedPositionEmbedding(nn.Embedding):
    """Absolute positions looked up in a learned table of ``max_positions`` rows (``padding_idx``: the row that
    padding tokens sit at, RoBERTa's, kept at zero)."""

    def __init__(self, max_positions: int, hidden_size: int, padding_idx: int | None = None) -> None:
        super().__init__(max_positions, hidden_size, padding_idx=padding_idx)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C)
        return super().forward(position_ids)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE): returns ``(cos, sin)`` for given positions.

    ``rope_parameters`` follows transformers' format (``{"rope_type": "default", "rope_theta": 10000.0, ...}``);
    scaled variants (``linear``, ``llama3``, ``yarn``, ...) reuse transformers' ``ROPE_INIT_FUNCTIONS`` so
    checkpoints converted from HF get the very same frequencies. The frequencies depend only on the head size,
    so tensor-parallel sharding of heads leaves them unchanged.
    """

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.rope_type = self.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the sequence length the frequencies are computed for (dynamic rope), or None: the short factors (longrope)
        self.frequencies_for = None if self.rope_type == "longrope" else max_positions

    def compute_inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies for this module's rope type (also used to re-initialise after meta-device init);
        ``seq_len``: the length a dynamic or long rope scales for."""
        if self.rope_type == "default":
            theta = float(self.rope_parameters.get("rope_theta", 10000.0))
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (theta**exponents), 1.0
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # The HF functions read a config; a one-head Llama config carries exactly the fields they look at.
        cfg = LlamaConfig(hidden_size=self.head_dim, num_attention_heads=1, head_dim=self.head_dim,
                          max_position_embeddings=self.max_positions, rope_parameters=dict(self.rope_parameters))
        return ROPE_INIT_FUNCTIONS[self.rope_type](cfg, None, seq_len=seq_len)

    def _rescale(self, position_ids: torch.Tensor) -> None:
        """transformers' rules for the rope types whose frequencies depend on the sequence: "dynamic" NTK scaling
        recomputes them for a sequence longer than any seen so far, and returns to the original ones for a sequence
        within ``max_positions``; "longrope" takes its long factors past ``original_max_position_embeddings``, its
        short ones within. (Reads the positions' values: not for ``torch.compile(fullgraph=True)``, as in
        transformers.)"""
        seq_len = int(position_ids.max()) + 1
        if self.rope_type == "longrope":
            original = int(self.rope_parameters["original_max_position_embeddings"])
            wanted = original + 1 if seq_len > original else None
            if wanted != self.frequencies_for:
                self.inv_freq = self.compute_inv_freq(wanted)[0].to(self.inv_freq.device)
                self.frequencies_for = wanted
        elif seq_len > self.frequencies_for:  # growth: scale for this length
            self.inv_freq = self.compute_inv_freq(seq_len)[0].to(self.inv_freq.device)
            self.frequencies_for = seq_len
        elif seq_len < self.max_positions < self.frequencies_for:  # back within the original length: reset
            self.inv_freq = self.compute_inv_freq()[0].to(self.inv_freq.device)
            self.frequencies_for = self.max_positions

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` (B, T) -> ``cos``, ``sin`` of shape (B, T, head_dim) in ``dtype``."""
        if "dynamic" in self.rope_type or self.rope_type == "longrope":
            self._rescale(position_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` of shape (B, nh, T, hs) by ``cos``/``sin`` of shape (B, T, hs)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def padding_aware_position_ids(input_ids: torch.Tensor, padding_idx: int, past_length: int = 0) -> torch.Tensor:
    """RoBERTa's absolute positions (fairseq's rule): the real tokens of a row are numbered ``padding_idx + 1``,
    ``padding_idx + 2``, ... in order, padding tokens sit at ``padding_idx`` (a row of zeros in a table trained that
    way). ``input_ids`` (B, T) -> position ids (B, T); ``past_length`` shifts the numbering of the real tokens."""
    real = input_ids.ne(padding_idx).int()
    return ((torch.cumsum(real, dim=1).type_as(real) + past_length) * real).long() + padding_idx


class EmbeddingNorm(nn.Module):
    """The norm and dropout applied to the summed token, position and token-type embeddings (BERT, RoBERTa).

    One module, so sequence parallelism can split the sequence at its input: its norm then works on each rank's
    share of the tokens, like every other norm of the model.
    """

    def __init__(self, hidden_size: int, eps: float, dropout: float = 0.0, norm_type: str = "layernorm",
                 bias: bool = True) -> None:
        super().__init__()
        self.norm = build_norm(norm_type, hidden_size, eps, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.dropout(self.norm(embeddings))
