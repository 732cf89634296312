"""Multi-head / grouped-query attention on ``scaled_dot_product_attention`` with transformers' ``Cache`` API:
self-attention (causal or bidirectional) and cross-attention (queries from a decoder, keys/values from an encoder
output, cached once per generation in an ``EncoderDecoderCache``), with an optional additive position bias (T5) and
optional per-head RMSNorms of the queries and keys before the rotary positions (Qwen3, OLMo-2-style ``q_norm`` /
``k_norm`` over ``head_dim``: each head normalised on its own, so a tensor-parallel rank holding some heads norms
exactly those, with the one shared weight).

Parallel-aware by construction: projections are separate ``q_proj``/``k_proj``/``v_proj`` (declared
``colwise``) and ``o_proj`` (``rowwise``), and every shape is computed from the *local* tensor
(``view(b, t, -1, head_dim)``), so when tensor parallelism shards the projections across ranks each rank simply
sees fewer heads and the same code runs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MindFormersError
from .autocast_input import cast_for_autocast
from .dropout import cheap_dropout_applies
from .dropout import dropout as apply_dropout
from .embedding import apply_rotary
from .document_mask import DocumentMask
from .masks import additive_mask
from .norms import RMSNorm


class Attention(nn.Module):
    """Self-attention: causal (decoders) or bidirectional (encoders), MHA or GQA, optional rotary positions; or, with
    ``cross_attention``, attention from a decoder's states to an encoder's output.

    Args:
        hidden_size: model width (input and output size).
        num_heads: query heads.
        num_kv_heads: key/value heads (``num_heads`` for MHA, fewer for GQA, 1 for MQA).
        head_dim: size of each head.
        qkv_bias: biases on the q/k/v projections (GPT-2, Qwen2, BERT).
        out_bias: bias on the output projection (GPT-2, BERT).
        dropout: dropout on attention probabilities during training.
        is_causal: decoder (True) or encoder (False) attention.
        layer_idx: index of this layer in the KV cache.
        scale: softmax scale; ``None`` means ``1/sqrt(head_dim)``.
        config: the model config, read at every call for ``_attn_implementation`` (transformers' switch, set by
            ``attn_implementation=`` or ``model.set_attn_implementation``): ``"eager"`` computes the softmax
            explicitly and returns the attention weights; anything else runs SDPA and returns None for them.
        cross_attention: keys and values come from ``key_value_states`` (an encoder's output) given to ``forward``
            instead of the layer's input. With a transformers ``EncoderDecoderCache`` they are computed at the first
            call, kept in its ``cross_attention_cache`` and reused at the later decoding steps (its ``is_updated``
            flags, as transformers' encoder-decoder models do).
        upcast: under the eager implementation, compute the scores and their softmax in float32 whatever the
            inputs' dtype (GPT-2's ``reorder_and_upcast_attn``: stability in mixed precision).
        qk_norm: an RMSNorm over ``head_dim`` on every query head (``q_norm``) and key head (``k_norm``), applied
            before the rotary positions (Qwen3). Its weights are shared by the heads, so under tensor parallelism
            they stay whole on every rank and their gradients are summed over the ranks (the plan's
            ``replicated_with_grad_allreduce``).
        norm_eps: epsilon of the q/k norms.
        sliding_window: this layer's window (keys further back are hidden), or None for full attention. The mask the
            model builds carries it; kept here so what replaces the attention core (context parallelism) sees each
            layer's own window when layers mix sliding and full attention (``layer_types``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        dropout: float = 0.0,
        is_causal: bool = True,
        layer_idx: int = 0,
        scale: float | None = None,
        config=None,
        cross_attention: bool = False,
        upcast: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.cross_attention = cross_attention
        self.upcast = upcast
        self.sliding_window = sliding_window
        num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.dropout = dropout
        self.scale = scale
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=out_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None

    def _heads(self, proj: nn.Module, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) projected to (B, heads, T, hs), each head normed on its own first when the layer has
        q/k norms (on (B, T, heads, hs), the layout a tensor-parallel rank's norm sees its heads in)."""
        b, t, _ = x.shape
        out = proj(x).view(b, t, -1, self.head_dim)
        if norm is not None:
            out = norm(out)
        return out.transpose(1, 2)

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
        """``hidden_states`` (B, T, C) -> ((B, T, C), attention weights (B, nh, T, S) or None).

        ``attention_mask`` is the boolean (B, 1, T, S) mask from :func:`build_attention_mask` or ``None``;
        ``position_embeddings`` the rotary ``(cos, sin)``; ``past_key_values`` a transformers ``Cache`` (an
        ``EncoderDecoderCache`` for cross-attention). ``position_bias`` is an additive float term (B or 1, nh, T, S)
        on the attention scores, with ``-inf``-like values where a query must not look (T5's relative position bias
        folded with the masks by :func:`~mindformers_py.layers.masks.additive_mask`); it must carry causality, and
        a boolean ``attention_mask`` given with it is folded into it. ``key_value_states`` (B, S, C) is the encoder output a cross-attention
        layer attends to. The weights are computed only under the eager implementation (see ``config``), as in
        transformers. (The last two are keyword-only: tensor-parallel input hooks map the positional ones.)
        """
        b, t, _ = hidden_states.shape
        if position_bias is not None:
            attention_mask = position_bias if attention_mask is None else additive_mask(position_bias, attention_mask)
        if self.cross_attention:
            return self._cross_attend(hidden_states, attention_mask, past_key_values, key_value_states)
        hidden_states = cast_for_autocast(hidden_states)
        q = self._heads(self.q_proj, self.q_norm, hidden_states)  # (B, nh, T, hs)
        k = self._heads(self.k_proj, self.k_norm, hidden_states)  # (B, nkv, T, hs)
        v = self._heads(self.v_proj, None, hidden_states)
        if position_embeddings is not None:
            q, k = apply_rotary(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        eager = getattr(self.config, "_attn_implementation", None) == "eager"
        y, weights = self.core(
            q, k, v, attention_mask,
            is_causal=self.is_causal and attention_mask is None and t > 1,
            dropout=self.dropout if self.training else 0.0,
            scale=self.scale,
            return_weights=eager,
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), weights

    def _cross_attend(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, cache,
                      source: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cross-attention of ``hidden_states`` (B, T, C) to ``source`` (B, S, C), whose keys/values an
        ``EncoderDecoderCache`` keeps after the first call (``source`` may then be None)."""
        b, t, _ = hidden_states.shape
        q = self._heads(self.q_proj, self.q_norm, hidden_states)  # (B, nh, T, hs)
        cross = getattr(cache, "cross_attention_cache", None)
        if cross is not None and cache.is_updated.get(self.layer_idx):
            k, v = cross.layers[self.layer_idx].keys, cross.layers[self.layer_idx].values
        elif source is None:
            raise MindFormersError("a cross-attention layer needs key_value_states (the encoder output) until its "
                                   "keys and values are cached")
        else:
            source = cast_for_autocast(source)
            k = self._heads(self.k_proj, self.k_norm, source)  # (B, nkv, S, hs)
            v = self._heads(self.v_proj, None, source)
            if cross is not None:
                k, v = cross.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        eager = getattr(self.config, "_attn_implementation", None) == "eager"
        y, weights = self.core(q, k, v, mask, is_causal=False, dropout=self.dropout if self.training else 0.0,
                               scale=self.scale, return_weights=eager)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1)), weights

    def core(self, q, k, v, mask, is_causal: bool, dropout: float = 0.0, scale: float | None = None,
             return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layer's softmax(q kᵀ) v, i.e. :func:`attention_core`. Selective recompute replaces it on the
        instance with a checkpointed call, so only this part is re-run in backward."""
        return attention_core(q, k, v, mask, is_causal, dropout, scale, return_weights, self.upcast)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    dropout: float = 0.0,
    scale: float | None = None,
    return_weights: bool = False,
    upcast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q kᵀ · scale + mask) v with grouped-query key/value heads broadcast to the query heads; returns the
    output (B, nh, T, hs) and, with ``return_weights``, the attention probabilities (B, nh, T, S) computed
    explicitly in fp32 as transformers' eager attention does (else SDPA, and None); ``upcast`` computes those
    scores in fp32 too (GPT-2's ``reorder_and_upcast_attn``). ``mask`` is boolean (True where a query may look) or
    a float term added to the scores (a position bias with the masking folded in).

    On the CPU two more cases take the explicit path (see :func:`_explicit_is_faster`): dropout, where SDPA falls
    back to its math kernel with torch's slower dropout (here :func:`~mindformers_py.layers.dropout.dropout`), and
    bf16 autocast on short sequences, where torch's flash kernels are slower than three plain products.

    Grouped key/value heads are not repeated to the query heads where that can be avoided: a single query (a decode
    step) with a mask shared by the heads attends with each key/value head's query heads as rows of one head, and
    SDPA without a mask takes them as they are (``enable_gqa``, torch >= 2.5; with a mask CUDA's fused kernels would
    fall back to the math one, so the heads are repeated there, as transformers does). Repeated keys and values
    would be saved for backward at the query heads' count: 4x the bytes of Llama 3.2 1B's 8 key/value heads.

    A :class:`~mindformers_py.layers.document_mask.DocumentMask` (packed documents) runs block-sparse, or as its
    dense mask where the block path does not apply (returned weights, dropout, DTensors, other devices).

    A free function so recompute (``selective``) can checkpoint exactly this part of the layer.
    """
    if isinstance(mask, DocumentMask):
        if not (return_weights or dropout > 0) and mask.runs_on(q, k, v):
            return mask.attend(q, k, v, scale), None
        mask = mask.dense(q.device)
    if _cpu_autocast_bf16(q):  # rotary positions leave q and k in fp32: cast once, not at every product
        q, k, v = cast_for_autocast(q), cast_for_autocast(k), cast_for_autocast(v)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not return_weights and _one_query_shared_mask(q, mask):
        b, heads, _, _ = q.shape  # (B, nh, 1, hs) -> (B, nkv, groups, hs): the groups become query rows
        y, _ = attention_core(q.reshape(b, k.shape[1], groups, q.shape[-1]), k, v, mask, False, dropout, scale,
                              False, upcast)
        return y.reshape(b, heads, 1, y.shape[-1]), None
    explicit = return_weights or _explicit_is_faster(q, k, dropout)
    native_groups = groups > 1 and not explicit and _sdpa_takes_groups(q, k, v, mask)
    if groups > 1 and not native_groups:  # (B, nkv, S, hs) -> (B, nh, S, hs)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if not explicit:
        gqa = {"enable_gqa": True} if native_groups else {}
        if _cpu_autocast_bf16(q):
            return _cpu_autocast_sdpa(q, k, v, mask, dropout, is_causal, scale, **gqa), None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                              scale=scale, **gqa), None
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if upcast:
        with torch.autocast(q.device.type, enabled=False):
            scores = (q.float() * scale) @ k.float().transpose(-2, -1)
    else:
        scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
    if mask is not None and mask.is_floating_point():  # additive: a position bias, very negative where hidden
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if return_weights:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # torch's reduced-precision CPU softmax accumulates in fp32 without two casts of (T, S)
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
    return apply_dropout(weights, dropout, training=dropout > 0) @ v, weights


# Up to this many scores per (batch, head) the explicit bf16 path beats torch's CPU SDPA kernels under autocast
# (measured forward + backward, 2 cores: 256 x 256 x 64 dims 10.0 ms vs fp32 SDPA 15.6 / bf16 SDPA 13.2; 128 x 128:
# 5.7 vs 8.9 / 15.9; ViT's 50 x 50 x 16: 2.2 vs 2.3 / 12.8). Longer sequences keep SDPA, which never holds (T, S).
_EXPLICIT_MAX_SCORES = 512 * 512


_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # its enable_gqa argument
_SDPA_GQA_MAX_HEAD_DIM = 256  # the fused kernels' largest head size


def _sdpa_takes_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA can take fewer key/value heads than query heads for these plain tensors without falling back
    to its math kernel (no mask, equal head sizes within the fused kernels' limit)."""
    return (_SDPA_GQA and mask is None and type(q) is torch.Tensor and type(k) is torch.Tensor
            and q.shape[-1] == v.shape[-1] <= _SDPA_GQA_MAX_HEAD_DIM)


def _one_query_shared_mask(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """A single query position whose mask (if any) is the same for every head and query: (B or 1, 1, 1, S)."""
    return q.shape[-2] == 1 and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))


def _cpu_autocast_bf16(q: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.is_floating_point() and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _explicit_is_faster(q: torch.Tensor, k: torch.Tensor, dropout: float) -> bool:
    """Whether the explicit softmax(q kᵀ) v is the faster path for these plain CPU tensors."""
    if not cheap_dropout_applies(q):  # CUDA, DTensors, compiled code: SDPA
        return False
    return dropout > 0 or (_cpu_autocast_bf16(q) and q.shape[-2] * k.shape[-2] <= _EXPLICIT_MAX_SCORES)


def _cpu_autocast_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                       is_causal: bool, scale: float | None, **gqa: bool) -> torch.Tensor:
    """SDPA of bf16 autocast on the CPU for long sequences, computed in fp32 and returned in bf16. torch's CPU
    flash-attention kernels are slower in bf16 than in fp32 (measured: backward 3-8x for short sequences or small
    heads; equal for 256 x 64), and fp32 is also the more precise of the two."""
    with torch.autocast("cpu", enabled=False):
        mask = mask.float() if mask is not None and mask.is_floating_point() else mask
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout,
                                             is_causal=is_causal, scale=scale, **gqa)
    return out.to(q.dtype)
