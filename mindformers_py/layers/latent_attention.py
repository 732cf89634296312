"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2): keys and values come from one small latent per
token, ``c_kv`` (``kv_lora_rank`` wide, after ``kv_a_layernorm``), plus one rotary key shared by every head
(``qk_rope_head_dim`` wide); the queries optionally from a latent of their own (``q_lora_rank``).

Module and weight names are transformers' ``DeepseekV3Attention``'s (``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so checkpoints, tensor-parallel
plans and LoRA ``target_modules`` name them as there.

The cache holds what transformers' holds: the latent as the layer's "keys" (B, 1, S, kv_lora_rank) and the rotary
key as its "values" (B, 1, S, qk_rope_head_dim), ``kv_lora_rank + qk_rope_head_dim`` values per token and layer
(576 at DeepSeek-V3's shape, against 2 x 128 heads x 160 = 40,960 for the expanded keys and values). Any
transformers ``Cache`` and our :class:`~mindformers_py.generation.StaticKVCache` take them as they are (the two
tensors may have different widths).

A decode step (one new token, a cache) never expands the cached latents: ``kv_b_proj``'s key half is absorbed into
the query and its value half applied after the attention (DeepSeek-V2's weight absorption), so the step attends with
one key/value "head" of ``kv_lora_rank + qk_rope_head_dim`` / ``kv_lora_rank`` for all query heads. Longer inputs
(training, prompts) expand the latents into per-head keys and values, as transformers does.

Under tensor parallelism the latent projections and their norms stay whole on every rank, the up-projections split
by heads and ``o_proj`` by its input (see ``GPTConfig``'s plan); the rotary key goes through :attr:`shared_key`, the
plan's hook that sums its gradient over the ranks (each rank's heads use it). Computed with local sizes throughout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autocast_input import cast_for_autocast
from .attention import attention_core
from .embedding import apply_rotary
from .norms import RMSNorm

LATENT_NORM_EPS = 1e-6
"""Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds them with its RMSNorm's default, not the
config's ``rms_norm_eps``."""


def latent_softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """The softmax scale of MLA as transformers' DeepSeek-V3 computes it: ``qk_head_dim ** -0.5``, times ``mscale²``
    under a scaled RoPE (YaRN) whose ``mscale_all_dim`` is set, ``mscale = 0.1 · mscale_all_dim · ln(factor) + 1``
    (for ``factor > 1``)."""
    scale = qk_head_dim ** -0.5
    rope = rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


def apply_interleaved_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE over interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's checkpoint layout, ``rope_interleave``),
    each pair turned by one frequency; the rotated pairs come out de-interleaved (first elements, then second), as
    transformers lays them out, which leaves every q·k product the same. ``cos``/``sin`` (B, T, d) are
    :class:`RotaryEmbedding`'s (each frequency twice)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)

    def turn(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    return turn(q), turn(k)


class SharedKey(nn.Module):
    """The identity, on the rotary key every query head reads. Under tensor parallelism each rank's heads give it a
    part of its gradient; the plan's ``shared_by_heads`` style sums those parts over the ranks here (a module of its
    own so that the plan can name it: model code holds no parallel code)."""

    def forward(self, key: torch.Tensor) -> torch.Tensor:
        return key


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a sharded (DTensor) weight, or the weight itself."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


class LatentAttention(nn.Module):
    """Multi-head latent attention, a drop-in for :class:`~mindformers_py.layers.attention.Attention` in a
    :class:`~mindformers_py.layers.block.TransformerBlock` (same ``forward`` arguments and returns).

    Args:
        hidden_size: model width.
        num_heads: attention heads.
        q_lora_rank: width of the query latent (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), or None for one
            ``q_proj`` (DeepSeek-V2-Lite).
        kv_lora_rank: width of the key/value latent ``c_kv`` (what the cache keeps).
        qk_nope_head_dim: per-head query/key width without rotary positions (from ``kv_b_proj``).
        qk_rope_head_dim: per-head rotary width; the rotary key is one head shared by all.
        v_head_dim: per-head value width.
        bias: biases on ``q_a_proj`` (or ``q_proj``'s absence of one), ``kv_a_proj_with_mqa`` and ``o_proj``
            (transformers' ``attention_bias``).
        dropout: dropout on the attention probabilities in training.
        layer_idx: this layer's index in the cache.
        scale: softmax scale (see :func:`latent_softmax_scale`); None: ``(qk_nope + qk_rope) ** -0.5``.
        config: the model config, read for ``_attn_implementation`` (``"eager"`` returns the attention weights).
        rope_interleave: rotary positions over interleaved pairs (see :func:`apply_interleaved_rotary`), else over
            halves (Llama's ``rotate_half``).
    """

    # What parallel code reads from an Attention to split a sequence (context parallelism): causal self-attention
    # over the whole sequence.
    is_causal = True
    cross_attention = False
    sliding_window = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool = False,
        dropout: float = 0.0,
        layer_idx: int = 0,
        scale: float | None = None,
        config=None,
        rope_interleave: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.dropout = dropout
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = self.qk_head_dim ** -0.5 if scale is None else scale
        self.rope_interleave = rope_interleave
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.shared_key = SharedKey()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, heads, T, qk_head_dim)."""
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(b, t, -1, self.qk_head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values=None,
        *,
        position_bias: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` (B, T, C) -> ((B, T, C), attention weights (B, heads, T, S) or None), as
        :meth:`Attention.forward <mindformers_py.layers.attention.Attention.forward>` (``position_bias`` and
        ``key_value_states`` are not used by latent attention, which is self-attention with rotary positions)."""
        b, t, _ = hidden_states.shape
        x = cast_for_autocast(hidden_states)
        q_nope, q_rot = self._queries(x).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, t, self.kv_lora_rank)  # one "head": what the cache keeps
        k_rot = self.shared_key(k_rot).view(b, 1, t, self.qk_rope_head_dim)
        if position_embeddings is not None:
            rotate = apply_interleaved_rotary if self.rope_interleave else apply_rotary
            q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings)
        if past_key_values is not None:
            latent, k_rot = past_key_values.update(latent, k_rot, self.layer_idx)
        eager = getattr(self.config, "_attn_implementation", None) == "eager"
        dropout = self.dropout if self.training else 0.0
        if past_key_values is not None and t == 1 and self._absorbable():
            y, weights = self._absorbed(q_nope, q_rot, latent, k_rot, attention_mask, dropout, eager)
        else:
            k, v = self._expand(latent, k_rot)
            y, weights = self.core(torch.cat([q_nope, q_rot], dim=-1), k, v, attention_mask,
                                   is_causal=attention_mask is None and t > 1, dropout=dropout, scale=self.scale,
                                   return_weights=eager)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), weights

    def _expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys (B, heads, S, qk_head_dim) and values (B, heads, S, v_head_dim) from the latents."""
        b, _, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def _absorbable(self) -> bool:
        """Whether ``kv_b_proj`` is a plain linear layer whose weight is all it computes (an unmerged adapter on it,
        LoRA's, is not: then the latents are expanded)."""
        return type(self.kv_b_proj) is nn.Linear

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                  mask: torch.Tensor | None, dropout: float, eager: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of one query per head straight on the cached latents: ``q_nope`` is taken into the latent space
        by each head's key up-projection (``q_nope @ W_uk``), scores are ``[q_lat, q_rot] · [c_kv, k_rot]``, the
        mixed latents go out through each head's value up-projection (``@ W_uvᵀ``). Every query head attends to the
        same single key/value head, so :func:`attention_core` takes them as grouped-query heads."""
        w = _local(self.kv_b_proj.weight).view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # (heads, nope, r), (heads, v, r)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk.to(q_nope.dtype))
        q = torch.cat([q_latent, q_rot], dim=-1)  # (B, heads, 1, r + rope)
        k = torch.cat([latent, k_rot], dim=-1)  # (B, 1, S, r + rope)
        y, weights = self.core(q, k, latent, mask, is_causal=False, dropout=dropout, scale=self.scale,
                               return_weights=eager)
        return torch.einsum("bhtr,hvr->bhtv", y, w_uv.to(y.dtype)), weights

    def core(self, q, k, v, mask, is_causal: bool, dropout: float = 0.0, scale: float | None = None,
             return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q kᵀ) v, i.e. :func:`~mindformers_py.layers.attention.attention_core` (an instance attribute may
        replace it, as on :class:`~mindformers_py.layers.attention.Attention`)."""
        return attention_core(q, k, v, mask, is_causal, dropout, scale, return_weights)
