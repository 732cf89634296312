"""Attention masks: one boolean mask per forward pass, shared by all layers.

``None`` means "no mask needed": the attention layer then lets SDPA apply causality itself
(``is_causal=True``), which is the fast path for unpadded training batches and single-token decoding.

Padding-free packed rows (several sequences in one row, ``position_ids`` restarting at 0 for each, as trl's packing
and transformers' ``DataCollatorWithFlattening`` send them without an attention mask) get a block-diagonal causal
mask, so no token attends across a sequence boundary: transformers' rule (``find_packed_sequence_indices``).

Under ``torch.compile`` the checks that look at tensor values (is there padding? are rows packed?) are skipped
and the general mask is built, so the graph has no data-dependent branch.
"""

from __future__ import annotations

import torch


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    *,
    query_length: int,
    kv_length: int,
    kv_offset: int = 0,
    past_length: int = 0,
    causal: bool = True,
    sliding_window: int | None = None,
    device: torch.device | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean mask of shape (B or 1, 1, query_length, kv_length), True where a query may attend.

    Args:
        attention_mask: HF padding mask (B, S) with 1 for real tokens (S covers past + current tokens; a shorter
            mask, as with a preallocated cache, is padded as "not a token"), or a ready 4D mask, or None.
        query_length: number of new tokens in this forward pass.
        kv_length: number of key/value slots the layers will see (past + new, or a static cache's size).
        kv_offset: absolute position of key slot 0 (non-zero only for sliding-window caches).
        past_length: tokens already in the cache; query i sits at absolute position ``past_length + i``.
        causal: decoder self-attention (True) or bidirectional (False).
        sliding_window: keys further back than this many positions are hidden (Mistral/Qwen2 style).
        position_ids: (B or 1, query_length) positions; without ``attention_mask`` and cache, positions that
            restart mark packed sequences, which see only themselves.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.bool() if attention_mask.dtype != torch.bool else attention_mask
    compiling = torch.compiler.is_compiling()
    padded = attention_mask is not None and (compiling or not bool(attention_mask.all()))
    packed = packed_sequence_ids(position_ids, compiling) \
        if attention_mask is None and past_length == 0 and position_ids is not None and causal else None
    fills_kv = past_length + query_length == kv_length and kv_offset == 0
    if not padded and packed is None and sliding_window is None and fills_kv:
        if not causal or query_length == 1 or past_length == 0:
            return None  # SDPA's own is_causal (or nothing, for one query) is exact here
    if attention_mask is not None:
        device = attention_mask.device
    q_pos = torch.arange(query_length, device=device) + past_length  # (q,)
    k_pos = torch.arange(kv_length, device=device) + kv_offset  # (kv,)
    allowed = torch.ones(query_length, kv_length, dtype=torch.bool, device=device)
    if causal:
        allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    mask = allowed[None, None]  # (1, 1, q, kv)
    if packed is not None:  # (B, q): a token sees the tokens of its own sequence only
        mask = mask & (packed[:, None, :, None] == packed[:, None, None, :])
    if padded:
        keep = attention_mask.bool()
        if keep.shape[-1] < kv_length + kv_offset:
            keep = torch.nn.functional.pad(keep, (0, kv_length + kv_offset - keep.shape[-1]), value=False)
        keep = keep[:, kv_offset : kv_offset + kv_length]
        # Queries, padding ones included, see the real keys the mask allows them, as in transformers (a right-padding
        # query sees its row's real tokens before it, not itself). A query left with no key at all (left padding)
        # sees itself, so that SDPA stays finite (its output is never used).
        own = k_pos[None, :] == q_pos[:, None]
        mask = mask & keep[:, None, None, :]
        mask = mask | (own[None, None] & ~mask.any(-1, keepdim=True))
    return mask


def key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean (B, 1, 1, S) mask of an encoder's real tokens, for cross-attention to its output, from its padding
    mask (B, S) (a 4D mask is taken as it is); None when nothing is padded (the value check is skipped under
    ``torch.compile``)."""
    if mask is None or mask.dim() == 4:
        return None if mask is None else mask.bool()
    if not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask.bool()[:, None, None, :]


def packed_sequence_ids(position_ids: torch.Tensor, compiling: bool = False) -> torch.Tensor | None:
    """For each token, the index of its sequence within the row, where ``position_ids`` (B, T) restart (a position
    that is not the previous one plus one starts a new sequence); None when no row holds more than one sequence
    (only checked outside ``torch.compile``)."""
    ids = position_ids if position_ids.dim() == 2 else position_ids[None]
    starts = torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1) != 1
    sequence = starts.cumsum(-1)
    if not compiling and not bool((sequence[:, -1] > 0).any()):
        return None
    return sequence


def additive_mask(bias: torch.Tensor, mask: torch.Tensor | None, *, causal: bool = False) -> torch.Tensor:
    """An additive position bias (1 or B, nh, T, S) with a boolean ``mask`` (B or 1, 1, T, S, True where a query may
    attend, as :func:`build_attention_mask` returns it) folded in: the bias where allowed, the dtype's lowest value
    elsewhere. A ``causal`` layer given no mask (SDPA's own causality would have been used) gets its causal mask
    here (the queries being the last keys, query i sees the keys up to its own). Built once per stack and shared by its
    layers, as one float mask is all SDPA takes beside the scores (transformers does the same for T5)."""
    queries, keys = bias.shape[-2:]
    if mask is None and causal and queries > 1:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=bias.device).tril(keys - queries)[None, None]
    if mask is None:
        return bias
    return torch.where(mask.to(bias.device), bias, torch.finfo(bias.dtype).min)
