"""Document masks of packed rows as metadata, executed block-sparse: attention never crosses a document boundary and
no (S, S) matrix is built.

A packed row holds several documents back to back (positions restarting at each, as Megatron's
``reset_position_ids``, transformers' ``DataCollatorWithFlattening`` and trl's packing give them; or ``cu_seqlens``
/ document ids). :class:`DocumentMask` keeps each token's document index, (B, T) int32, and derives from it:

* **FlexAttention's** :class:`~torch.nn.attention.flex_attention.BlockMask`: for every tile of ``block_size``
  queries, the key tiles it sees partly (the diagonal, a document starting inside a tile) and wholly (earlier tiles of
  its document). Built from the tiles' first and last document (O(B (T/block)²) integers; with the document ids,
  4 rows of 8,192 tokens take 0.38 MiB, against 256 MiB for the boolean matrix), never by evaluating the mask over
  every pair.
* the **execution**: on CUDA, ``flex_attention`` with that block mask (compiled); on the CPU, where torch's
  FlexAttention has no backward, :class:`BlockSparseAttention`, the varlen kernels' way: one call of torch's fused
  CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``, with its log-sum-exp) per document of at
  least a tile (causal, no mask) or per group of shorter consecutive documents (a tile at most, with their small
  block-diagonal mask); no pair of tokens of different spans is computed, and backward reruns the kernel's backward
  per span from the saved output and log-sum-exp.
* the **dense** boolean mask, only as the reference the tests compare with and the fallback for what the block path
  does not cover (dropout on attention probabilities, the eager implementation's returned weights, DTensors,
  ``torch.compile``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK_SIZE = 128
"""Tokens per tile of the block mask (FlexAttention's default)."""

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class DocumentMask:
    """Which tokens of packed rows attend to which: causal attention within each document, none across.

    Args:
        documents: (B or 1, T) index of each token's document within its row, non-decreasing along the row (a new
            value starts a new document).
        block_size: tokens per tile of :meth:`block_mask`.
    """

    causal = True

    def __init__(self, documents: torch.Tensor, block_size: int = BLOCK_SIZE) -> None:
        self.documents = documents.to(torch.int32)
        self.block_size = block_size

    # -- construction ------------------------------------------------------------------------------------------------

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> DocumentMask:
        """From positions (B or 1, T) that restart where a document starts (a position that is not the previous one
        plus one), transformers' rule for padding-free rows."""
        ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        starts = torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1) != 1
        return cls(starts.cumsum(-1), block_size)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, length: int | None = None,
                        block_size: int = BLOCK_SIZE) -> DocumentMask:
        """From the cumulative document lengths of one flattened row (``[0, n0, n0 + n1, ...]``: flash-attention's
        ``cu_seqlens``, transformers' ``cu_seq_lens_q``); tokens past the last bound (padding) form one more
        document."""
        length = int(cu_seqlens[-1]) if length is None else length
        bounds = cu_seqlens.to(torch.long)[1:-1]
        documents = torch.zeros(length, dtype=torch.long, device=cu_seqlens.device)
        documents[bounds[bounds < length]] += 1
        if int(cu_seqlens[-1]) < length:
            documents[int(cu_seqlens[-1])] += 1
        return cls(documents.cumsum(0)[None], block_size)

    @classmethod
    def from_document_ids(cls, ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> DocumentMask:
        """From any per-token document labels (B, T) (transformers' ``seq_idx``): each run of equal labels is one
        document."""
        ids = ids if ids.dim() == 2 else ids[None]
        starts = torch.diff(ids, prepend=ids[:, :1], dim=-1) != 0
        return cls(starts.cumsum(-1), block_size)

    # -- what it holds -----------------------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of the dense mask it stands for: (B or 1, 1, T, T)."""
        b, t = self.documents.shape
        return b, 1, t, t

    @property
    def device(self) -> torch.device:
        return self.documents.device

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """The boolean (B or 1, 1, T, T) mask, True where a query may attend: the reference and the fallback."""
        docs = self.documents.to(device) if device is not None else self.documents
        t = docs.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool, device=docs.device).tril()
        return causal[None, None] & (docs[:, None, :, None] == docs[:, None, None, :])

    def mask_mod(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """FlexAttention's ``mask_mod``: whether query ``q_idx`` of row ``b`` sees key ``kv_idx``."""
        docs = self.documents
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(partial, full)``: (B, nq, nk) booleans over tiles of ``block_size`` tokens: key tile j is seen partly /
        wholly by query tile i."""
        docs, bs = self.documents, self.block_size
        t = docs.shape[-1]
        first = docs[:, ::bs]  # (B, n): each tile's first and last document
        last = docs[:, torch.clamp(torch.arange(bs - 1, t + bs - 1, bs, device=docs.device), max=t - 1)]
        n = first.shape[-1]
        i = torch.arange(n, device=docs.device)
        before = (i[None, :] <= i[:, None])[None]  # key tile at or before the query tile
        meets = before & (last[:, None, :] >= first[:, :, None])  # some key of the query's documents
        whole = (i[None, :] < i[:, None])[None] & (first[:, None, :] == last[:, None, :]) \
            & (first[:, :, None] == last[:, :, None]) & (first[:, None, :] == first[:, :, None])
        return meets & ~whole, whole

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        """FlexAttention's :class:`BlockMask` of this mask, built from the tiles (heads share it)."""
        partial, full = self.tiles()
        t = self.documents.shape[-1]

        def indices(which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counts = which.sum(-1, dtype=torch.int32)[:, None]  # (B, 1, nq)
            order = torch.sort((~which).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
            return counts, order[:, None]  # (B, 1, nq, nk): the seen tiles first, ascending

        kv_num, kv_idx = indices(partial)
        full_num, full_idx = indices(full)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.block_size,
                                        mask_mod=self.mask_mod, seq_lengths=(t, t))

    @property
    def nbytes(self) -> int:
        """Bytes held: the document ids and the block mask's tables."""
        mask = self.block_mask
        tables = [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                  mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices]
        return self.documents.nbytes + sum(x.nbytes for x in tables if x is not None)

    # -- execution ---------------------------------------------------------------------------------------------------

    @functools.cached_property
    def plan(self) -> list[list[tuple[slice, bool]]]:
        """Per row, the spans the CPU path computes, ``(span, masked)``: a document of at least ``block_size``
        tokens alone (its queries see its keys causally: no mask), or consecutive shorter documents together, up to
        ``block_size`` tokens (one call with the span's small block-diagonal mask). Every other (query, key) pair of
        the row is hidden and never computed: the varlen kernels' way, with the tiles' size bounding the waste."""
        bs, t = self.block_size, self.documents.shape[-1]
        changes = (self.documents[:, 1:] != self.documents[:, :-1]).cpu()
        rows = []
        for change in changes:
            bounds = [0, *(torch.nonzero(change).flatten() + 1).tolist(), t]
            spans: list[tuple[slice, bool]] = []
            start, count = 0, 0  # the group of short documents being gathered
            for a, b in zip(bounds, bounds[1:]):
                if b - a >= bs or b - start > bs:  # close the group first
                    if count:
                        spans.append((slice(start, a), count > 1))
                    start, count = a, 0
                if b - a >= bs:
                    spans.append((slice(a, b), False))
                    start = b
                else:
                    count += 1
            if count:
                spans.append((slice(start, t), count > 1))
            rows.append(spans)
        return rows

    def call_mask(self, row: int, span: slice, dtype: torch.dtype) -> torch.Tensor:
        """The additive (1, 1, n, n) mask of one span of the CPU path: 0 where a query sees a key, the dtype's lowest
        value elsewhere (not -inf: the fused kernel then needs no special case)."""
        docs = self.documents[row, span]
        n = docs.shape[0]
        allowed = torch.ones(n, n, dtype=torch.bool, device=docs.device).tril() & (docs[:, None] == docs[None, :])
        hidden = torch.zeros(n, n, dtype=dtype, device=docs.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return hidden[None, None]

    def runs_on(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`attend` takes these tensors: plain CPU or CUDA tensors of this mask's length, outside
        ``torch.compile`` (which gets the dense mask, as it has no data-dependent plan)."""
        return (all(type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") for t in (q, k, v))
                and q.shape[-2] == k.shape[-2] == self.documents.shape[-1] and v.shape[-1] == q.shape[-1]
                and q.shape[1] % k.shape[1] == 0 and self.documents.shape[0] in (1, q.shape[0])
                and not torch.compiler.is_compiling())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """softmax(q kᵀ · scale, masked) v for (B, h, T, hs) queries and (B, h_kv, T, hs) keys / values (h_kv divides
        h: grouped-query heads), block-sparse: FlexAttention on CUDA, :class:`BlockSparseAttention` elsewhere."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.device.type == "cuda":
            return _compiled_flex_attention()(q, k, v, block_mask=self.block_mask, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
        dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):  # fp32 on the CPU: its bf16 kernels are slower, not faster
            out = BlockSparseAttention.apply(q.float(), k.float(), v.float(), self, scale)
        return out.to(dtype)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _units(mask: DocumentMask, batch: int) -> list[tuple[slice, list[tuple[slice, bool]], int]]:
    """``(batch rows, spans, mask row)``: every row with its own spans, or all rows at once when one row of
    positions serves the batch."""
    if len(mask.plan) == 1:
        return [(slice(None), mask.plan[0], 0)]
    return [(slice(b, b + 1), mask.plan[b], b) for b in range(batch)]


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key / value heads (batch, heads, n, d) repeated to the query heads (grouped-query attention), for kernels
    that take as many key/value heads as query heads."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradients of key/value heads repeated by :func:`repeat_kv`, summed back to their head."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class BlockSparseAttention(torch.autograd.Function):
    """Attention of packed rows over a :class:`DocumentMask` with torch's fused CPU kernel, forward and backward:
    one call per span of :attr:`DocumentMask.plan` (a long document, causal; or a group of short ones with their
    small mask); nothing across spans is computed. Keys and values of grouped-query heads are repeated per call and
    their gradients folded back; only q, k, v, the output and its log-sum-exp are kept for backward (the small masks
    are rebuilt)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                scale: float) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for rows, spans, row in _units(mask, q.shape[0]):
            for span, masked in spans:
                additive = mask.call_mask(row, span, q.dtype) if masked else None
                at = (rows, slice(None), span)
                o, l = _FLASH_CPU(q[at], repeat_kv(k[at], groups), repeat_kv(v[at], groups), 0.0, not masked,
                                  attn_mask=additive, scale=scale)
                out[at], lse[at] = o, l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale = ctx.mask, ctx.scale
        groups = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows, spans, row in _units(mask, q.shape[0]):
            for span, masked in spans:
                additive = mask.call_mask(row, span, q.dtype) if masked else None
                at = (rows, slice(None), span)
                gq, gk, gv = _FLASH_CPU_BACKWARD(dout[at], q[at], repeat_kv(k[at], groups), repeat_kv(v[at], groups),
                                                 out[at], lse[at], 0.0, not masked, attn_mask=additive, scale=scale)
                dq[at], dk[at], dv[at] = gq, fold_kv(gk, groups), fold_kv(gv, groups)
        return dq, dk, dv, None, None
