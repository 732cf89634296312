"""Attention over a sequence split across context-parallel ranks: Ulysses, ring and hybrid.

Each rank holds its chunks of every sequence (:mod:`.layout`) and projects its own queries, keys and values.
What each algorithm does with them (``q`` (B, heads, n, hs) for the rank's n tokens):

* **Ulysses** (DeepSpeed-Ulysses): an all-to-all turns "all heads of my tokens" into "my heads of all the group's
  tokens"; attention then runs whole, per head, with the same mask and position bias a single device would build
  (:func:`~mindformers_py.layers.masks.build_attention_mask`, :func:`~mindformers_py.layers.attention_core`), and
  a second all-to-all turns the result back. Key/value heads that the group does not divide (GQA, MQA) are repeated
  to the query heads first. Autograd runs through torch's functional all-to-all.
* **Ring** (Liu et al., ring attention; Megatron's and torchtitan's context parallelism): keys and values travel
  around the ranks by point-to-point sends (``torch.distributed.batch_isend_irecv``, each step's send overlapping
  that step's compute); each rank attends its queries to every block as it passes, and the partial results are
  merged with their log-sum-exp (an online softmax). Backward sends the blocks around again, with their gradients
  accumulating alongside and returning to their owner. Blocks that a causal mask hides are skipped, which is why a
  causal sequence gets the load-balanced layout; blocks wholly visible run without a mask, the diagonal ones as
  causal.
* **Hybrid**: Ulysses within groups of adjacent ranks, the ring across the groups (on the heads each group member
  then holds).

A block is computed by torch's fused CPU attention kernel with its log-sum-exp
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; torch's own context-parallel attention
dispatches only CUDA kernels; latent attention's narrower values are zero-padded to the key width for the kernel
only, so they travel the ring at their own width), or, on other devices and for a learned position bias (T5), by an explicit softmax
in fp32 whose backward also yields the bias gradient. Either way only one block's scores exist at a time, and
backward recomputes them from the saved log-sum-exp.

Masks are those of a single device, built per block from the whole sequence's padding and document ids
(:class:`AttentionView`): causal or not, Mistral's sliding window, padding (a query sees the real keys it may see,
and only itself when there are none), packed documents (positions restarting at 0), as
:func:`~mindformers_py.layers.masks.build_attention_mask` does.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_fn  # all_reduce with a summed gradient
from torch import nn

from ...layers.attention import attention_core
from ...layers.document_mask import fold_kv, repeat_kv
from ...layers.masks import additive_mask, build_attention_mask, packed_sequence_ids
from ...layers.position_bias import relative_position_bucket
from .layout import ContextLayout

# ---------------------------------------------------------------------------------------------------------------
# What one forward pass's attention must see: the whole sequence's masks, per stack.
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionView:
    """The whole sequence behind one stack's forward pass on a context-parallel rank.

    Attributes:
        layout: how the sequence is split (positions of each rank's tokens).
        attention_mask: the padding mask (B, T) of the whole sequence in sequence order, or None when the batch
            had none (the model's ``attention_mask`` argument, gathered).
        position_ids: the positions (B, T) of the whole sequence, or None; packed rows restart them.
        causal: decoder (True) or encoder (False) self-attention.
        sliding_window: keys further back than this are hidden (Mistral), or None.
        bias: the stack's relative position bias module (T5), or None.
    """

    layout: ContextLayout
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    causal: bool
    sliding_window: int | None = None
    bias: nn.Module | None = None

    def full_mask(self, device: torch.device) -> torch.Tensor | None:
        """The mask a single device would build for this sequence: boolean (B or 1, 1, T, T), the
        :class:`~mindformers_py.layers.document_mask.DocumentMask` of packed rows (which Ulysses' whole attention
        runs block-sparse), or None (SDPA's own causality, or nothing, is exact)."""
        return build_attention_mask(self.attention_mask, query_length=self.layout.length,
                                    kv_length=self.layout.length, causal=self.causal,
                                    sliding_window=self.sliding_window, device=device, position_ids=self.position_ids)

    @functools.cached_property
    def keep(self) -> torch.Tensor | None:
        """(B, T) real tokens when the batch is padded, else None (as :func:`build_attention_mask` decides)."""
        if self.attention_mask is None or bool(self.attention_mask.all()):
            return None
        return self.attention_mask.bool()

    @functools.cached_property
    def sees_a_key(self) -> torch.Tensor | None:
        """(B, T) whether each query of a padded batch has a real key it may see in the whole sequence (a query
        without one sees itself instead); None when the batch is not padded."""
        keep = self.keep
        if keep is None:
            return None
        upto = keep.long().cumsum(-1)  # real keys at or before each position
        seen = upto if self.causal else upto[:, -1:].expand_as(upto)
        if self.sliding_window is not None:  # minus those at or before q - window, which it no longer sees
            seen = seen - torch.nn.functional.pad(upto, (self.sliding_window, 0))[:, :upto.shape[-1]]
        return seen > 0

    @functools.cached_property
    def documents(self) -> torch.Tensor | None:
        """(B, T) index of each token's document in packed rows (causal, no padding mask), else None."""
        if self.attention_mask is not None or self.position_ids is None or not self.causal:
            return None
        return packed_sequence_ids(self.position_ids)

    def block_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """The boolean (B or 1, 1, nq, nk) mask between queries at sequence positions ``q_pos`` and keys at
        ``k_pos``: the part of :meth:`full_mask` they index, built without the rest. None when every query sees
        every key and no structure needs a mask (the caller classifies the causal structure itself)."""
        keep, docs = self.keep, self.documents
        q, k = q_pos[:, None], k_pos[None, :]
        allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        if self.causal:
            allowed = k <= q
        if self.sliding_window is not None:
            allowed = allowed & (k > q - self.sliding_window)
        mask = allowed[None, None]
        if docs is not None:
            mask = mask & (docs[:, q_pos][:, None, :, None] == docs[:, k_pos][:, None, None, :])
        if keep is not None:
            lonely = ~self.sees_a_key[:, q_pos]  # (B, nq)
            mask = (mask & keep[:, k_pos][:, None, None, :]) | ((k == q)[None, None] & lonely[:, None, :, None])
        return mask

    @property
    def plain(self) -> bool:
        """Whether the causal structure (and nothing else) decides which keys a query sees."""
        return self.keep is None and self.documents is None


def position_bias_between(module: nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """T5's relative position bias (1, heads, nq, nk) between queries and keys at arbitrary sequence positions, from
    a :class:`~mindformers_py.layers.position_bias.RelativePositionBias` (its forward only knows contiguous ones)."""
    buckets = relative_position_bucket(k_pos[None, :] - q_pos[:, None], module.bidirectional, module.num_buckets,
                                       module.max_distance)
    return module.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


# ---------------------------------------------------------------------------------------------------------------
# One block: softmax(q kᵀ) v with its log-sum-exp, and the gradients given the merged output and log-sum-exp.
# ---------------------------------------------------------------------------------------------------------------

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as an additive one: the dtype's lowest value where hidden. (Not -inf: a block may hide every
    key from a query, whose log-sum-exp then is hugely negative and weighs nothing in the merge, instead of NaN.)"""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _fused(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return q.device.type == "cpu" and bias is None


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zeros appended to its last dimension up to ``width``: the fused CPU kernel needs queries, keys and
    values of one width, latent attention's values are narrower than its keys (zero columns of a value add zero
    columns to the output; zero columns of a query and key add nothing to their products)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def block_forward(q, k, v, mask, bias, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, h, nq, v's hs) in q's dtype, lse (B, h, nq) fp32)`` of one block; ``mask`` boolean or None,
    ``bias`` an additive (1 or B, h, nq, nk) float term or None, ``causal`` the top-left triangle (equal ranges
    only). The values may be narrower or wider than the queries and keys (latent attention)."""
    if _fused(q, bias):
        width = max(q.shape[-1], v.shape[-1])
        out, lse = _FLASH_CPU(_widened(q, width), _widened(k, width), _widened(v, width), 0.0, causal,
                              attn_mask=_additive(mask, q.dtype), scale=scale)[:2]
        return out[..., :v.shape[-1]], lse.float()
    scores = _scores(q, k, mask, bias, causal, scale)
    lse = torch.logsumexp(scores, -1)
    return (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype), lse


def block_backward(dout, q, k, v, out, lse, mask, bias, causal: bool, scale: float):
    """``(dq, dk, dv, dbias)`` of one block's part of attention whose merged output and log-sum-exp are ``out``
    and ``lse`` (dbias None without a bias)."""
    if _fused(q, bias):
        width = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _FLASH_CPU_BACKWARD(_widened(dout, width), _widened(q, width), _widened(k, width),
                                         _widened(v, width), _widened(out, width), lse, 0.0, causal,
                                         attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]], None
    probs = torch.exp(_scores(q, k, mask, bias, causal, scale) - lse[..., None])  # (B, h, nq, nk)
    dout32 = dout.float()
    dv = probs.transpose(-2, -1) @ dout32
    dp = dout32 @ v.float().transpose(-2, -1)
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-2, -1) @ q.float()) * scale
    dbias = None
    if bias is not None:
        dbias = ds.sum(0, keepdim=True) if bias.shape[0] == 1 else ds
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


def _scores(q, k, mask, bias, causal: bool, scale: float) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(),
                                    torch.finfo(torch.float32).min)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    return scores


# ---------------------------------------------------------------------------------------------------------------
# Ring attention.
# ---------------------------------------------------------------------------------------------------------------

SKIP, FULL, DIAGONAL, MASKED = "skip", "full", "diagonal", "masked"


def classify(q_run: tuple[int, int], k_run: tuple[int, int], causal: bool, window: int | None) -> str:
    """How queries at positions ``[q0, q1)`` see keys at ``[k0, k1)`` under the causal structure and a sliding
    window: not at all, wholly, as a causal diagonal (equal ranges), or partly (a mask is needed)."""
    (q0, q1), (k0, k1) = q_run, k_run
    if not causal:
        return FULL
    if k0 > q1 - 1 or (window is not None and k1 - 1 <= q0 - window):
        return SKIP
    near = window is None or k0 > q1 - 1 - window
    if k1 - 1 <= q0 and near:
        return FULL
    if (q0, q1) == (k0, k1) and (window is None or window >= q1 - q0):
        return DIAGONAL
    return MASKED


@dataclasses.dataclass
class RingPlan:
    """Everything a ring attention call needs beside its tensors (kept for backward)."""

    view: AttentionView
    group: dist.ProcessGroup
    rank: int
    size: int
    scale: float
    kv_groups: int  # query heads per key/value head (GQA): keys and values travel unrepeated
    bias_heads: slice | None = None  # this rank's heads of the position bias (tensor parallel x Ulysses)

    @property
    def next_peer(self) -> int:
        return dist.get_global_rank(self.group, (self.rank + 1) % self.size)

    @property
    def prev_peer(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def runs(self, ring_rank: int) -> list[tuple[int, int, int]]:
        return self.view.layout.ring_segments(ring_rank)

    def blocks(self, src: int, device: torch.device) -> list[tuple[slice, slice, str, torch.Tensor | None]]:
        """The (query rows, key rows, kind, mask) pieces of this rank's queries against ring rank ``src``'s keys
        that are not wholly hidden."""
        view, out = self.view, []
        for q_off, q0, q1 in self.runs(self.rank):
            for k_off, k0, k1 in self.runs(src):
                kind = classify((q0, q1), (k0, k1), view.causal, view.sliding_window)
                if kind == SKIP:
                    continue
                mask = None
                if kind == MASKED or not view.plain:
                    mask = view.block_mask(torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device))
                    kind = MASKED
                out.append((slice(q_off, q_off + q1 - q0), slice(k_off, k_off + k1 - k0), kind, mask))
        return out

    def bias_columns(self, src: int, device: torch.device) -> torch.Tensor:
        return self.view.layout.ring_indices(src).to(device)


def _exchange(tensor: torch.Tensor, plan: RingPlan) -> tuple[torch.Tensor, list]:
    """Send ``tensor`` to the next ring rank and receive the previous one's (started, not waited for)."""
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, plan.next_peer, plan.group),
           dist.P2POp(dist.irecv, received, plan.prev_peer, plan.group)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ·scale + bias, masked) v over the whole ring of ranks; q, k, v hold this rank's ring share.

    ``bias`` is None or the additive position bias (1, heads, nq, T) of this rank's queries against every position
    of the sequence (its gradient is returned too)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                plan: RingPlan) -> torch.Tensor:
        k, v = k.contiguous(), v.contiguous()
        b, h, n, _ = q.shape
        out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float32, device=q.device)  # values' width (MLA's own)
        lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for step in range(plan.size):
            src = (plan.rank - step) % plan.size
            pending = _exchange(kv, plan) if step < plan.size - 1 else None
            k_s = repeat_kv(kv[:k.numel()].view(k.shape), plan.kv_groups)
            v_s = repeat_kv(kv[k.numel():].view(v.shape), plan.kv_groups)
            columns = plan.bias_columns(src, q.device) if bias is not None else None
            for rows, cols, kind, mask in plan.blocks(src, q.device):
                block_bias = bias[..., rows, :][..., columns[cols]] if bias is not None else None
                o, l = block_forward(q[:, :, rows].contiguous(), k_s[:, :, cols].contiguous(),
                                     v_s[:, :, cols].contiguous(), mask, block_bias, kind == DIAGONAL, plan.scale)
                merged = torch.logaddexp(lse[:, :, rows], l)
                out[:, :, rows] = (torch.exp(lse[:, :, rows] - merged)[..., None] * out[:, :, rows]
                                   + torch.exp(l - merged)[..., None] * o.float())
                lse[:, :, rows] = merged
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, bias = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # for the block held now
        for step in range(plan.size):
            src = (plan.rank - step) % plan.size
            pending = _exchange(kv, plan) if step < plan.size - 1 else None
            k_s = repeat_kv(kv[:k.numel()].view(k.shape), plan.kv_groups)
            v_s = repeat_kv(kv[k.numel():].view(v.shape), plan.kv_groups)
            dk_s = torch.zeros(k_s.shape, dtype=torch.float32, device=q.device)
            dv_s = torch.zeros(v_s.shape, dtype=torch.float32, device=q.device)
            columns = plan.bias_columns(src, q.device) if bias is not None else None
            for rows, cols, kind, mask in plan.blocks(src, q.device):
                block_bias = bias[..., rows, :][..., columns[cols]] if bias is not None else None
                gq, gk, gv, gb = block_backward(dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(),
                                                k_s[:, :, cols].contiguous(), v_s[:, :, cols].contiguous(),
                                                out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), mask,
                                                block_bias, kind == DIAGONAL, plan.scale)
                dq[:, :, rows] += gq.float()
                dk_s[:, :, cols] += gk.float()
                dv_s[:, :, cols] += gv.float()
                if gb is not None:
                    target = columns[cols]
                    dbias[..., rows, :] = dbias[..., rows, :].index_add(-1, target, gb.float())
            dkv += torch.cat([fold_kv(dk_s, plan.kv_groups).reshape(-1), fold_kv(dv_s, plan.kv_groups).reshape(-1)])
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
            # The gradient of the block just used travels on with it; the one for the next block arrives.
            received, requests = _exchange(dkv, plan)
            _wait(requests)
            dkv = received
        dk, dv = dkv.split(k.numel())
        grads = (dq.to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
                 dbias.to(bias.dtype) if bias is not None else None, None)
        return grads


# ---------------------------------------------------------------------------------------------------------------
# Ulysses: sequence shards <-> head shards by all-to-all.
# ---------------------------------------------------------------------------------------------------------------


def sequence_to_heads(tensors: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    """Each (B, H_i, n, hs_i) of this rank's tokens -> (B, H_i/size, size·n, hs_i): its share of the heads over the
    group's tokens, rank by rank. All tensors travel in one all-to-all, flattened per destination rank, so their
    head counts (GQA) and widths (latent attention's values are narrower than its keys) may differ."""
    b, _, n, _ = tensors[0].shape
    shapes = [(t.shape[1] // size, t.shape[-1]) for t in tensors]
    parts = torch.cat([t.reshape(b, size, -1) for t in tensors], dim=2)  # (B, size, sum h_i·n·hs_i)
    received = funcol.all_to_all_single_autograd(parts.transpose(0, 1).contiguous(), None, None, group)
    chunks = received.split([h * n * d for h, d in shapes], dim=2)  # each (size, B, h_i·n·hs_i), rank by rank
    return [chunk.reshape(size, b, h, n, d).permute(1, 2, 0, 3, 4).reshape(b, h, size * n, d)
            for chunk, (h, d) in zip(chunks, shapes)]


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads` for one tensor: (B, H/size, size·n, hs) -> (B, H, n, hs)."""
    b, h, tokens, d = x.shape
    n = tokens // size
    parts = x.reshape(b, h, size, n, d).permute(2, 0, 1, 3, 4).contiguous()  # (size, B, H/size, n, hs)
    received = funcol.all_to_all_single_autograd(parts, None, None, group)
    return received.transpose(0, 1).reshape(b, size * h, n, d)


# ---------------------------------------------------------------------------------------------------------------
# The algorithms put together.
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ContextGroups:
    """The process groups of a rank's context parallelism and its place in them."""

    cp_group: dist.ProcessGroup
    cp: int
    cp_rank: int
    ring_group: dist.ProcessGroup | None = None
    ring: int = 1
    ring_rank: int = 0
    ulysses_group: dist.ProcessGroup | None = None
    ulysses: int = 1
    ulysses_rank: int = 0


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: AttentionView, groups: ContextGroups,
                      dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Self-attention of this rank's queries (B, h, n, hs) over the whole sequence of ``view``; returns (B, h, n, hs).

    ``k``/``v`` may have fewer heads (GQA). Dropout is applied by Ulysses' whole attention only (the ring refuses it
    before training starts)."""
    heads, scale = q.shape[1], scale if scale is not None else q.shape[-1] ** -0.5
    u, r = groups.ulysses, groups.ring
    if u > 1:
        if k.shape[1] % u:  # fewer key/value heads than the group: give every query head its own copy
            k, v = (repeat_kv(t, heads // t.shape[1]) for t in (k, v))
        q, k, v = sequence_to_heads([q, k, v], groups.ulysses_group, u)
    own = slice(groups.ulysses_rank * (heads // u), (groups.ulysses_rank + 1) * (heads // u))
    if r > 1:
        plan = RingPlan(view, groups.ring_group, groups.ring_rank, r, scale, q.shape[1] // k.shape[1])
        bias = None
        if view.bias is not None:
            layout = view.layout
            q_pos = layout.ring_indices(groups.ring_rank).to(q.device)
            bias = position_bias_between(view.bias, q_pos, torch.arange(layout.length, device=q.device))[:, own]
            bias = bias.to(q.dtype)
        out = RingAttention.apply(q, k, v, bias, plan)
    else:
        out = _whole_attention(q, k, v, view, dropout, scale, own)
    return heads_to_sequence(out, groups.ulysses_group, u) if u > 1 else out


def _whole_attention(q, k, v, view: AttentionView, dropout: float, scale: float, heads: slice) -> torch.Tensor:
    """Attention over the whole sequence (Ulysses after its exchange), masked as on a single device."""
    mask = view.full_mask(q.device)
    if view.bias is not None:
        positions = torch.arange(view.layout.length, device=q.device)
        bias = position_bias_between(view.bias, positions, positions)[:, heads].to(q.dtype)
        mask = additive_mask(bias, mask, causal=view.causal)
    out, _ = attention_core(q, k, v, mask, view.causal and mask is None, dropout, scale)
    return out


def gathered_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             groups: ContextGroups, dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Cross-attention of this rank's decoder queries to the whole encoder output: the keys and values (and the
    encoder's padding mask (B, 1, 1, S_local)) of every rank's source chunk are gathered first, in rank order
    (cross-attention has no positions, so the order does not matter). Every rank gathers a mask, all True where it
    has none, so the ranks' collectives always pair up."""
    heads = k.shape[1]  # keys and values in one collective
    kv = funcol.all_gather_single(torch.cat([k, v], dim=1).contiguous(), 2, groups.cp_group)
    k, v = kv[:, :heads], kv[:, heads:]
    local = mask if mask is not None else torch.ones(q.shape[0], 1, 1, k.shape[2] // groups.cp, dtype=torch.bool,
                                                     device=q.device)
    parts = [torch.empty_like(local) for _ in range(groups.cp)]
    dist.all_gather(parts, local.contiguous(), group=groups.cp_group)
    whole = torch.cat(parts, dim=-1)
    out, _ = attention_core(q, k, v, None if bool(whole.all()) else whole, False, dropout, scale)
    return out


def gather_sequence(x: torch.Tensor, layout: ContextLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence (B, T, ...) in sequence order from every rank's chunk (B, n, ...), with a gradient that
    returns each rank its chunk's share summed over the ranks (a head computed on every rank)."""
    whole = funcol.all_gather_single(x.contiguous(), 1, group)
    return whole.index_select(1, layout.restore().to(x.device))


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group``, with a summed gradient (statistics of every rank's tokens in one loss)."""
    return dist_fn.all_reduce(x, group=group)


__all__ = [
    "AttentionView",
    "ContextGroups",
    "RingAttention",
    "context_attention",
    "gather_sequence",
    "gathered_cross_attention",
    "heads_to_sequence",
    "sequence_to_heads",
    "sum_over_group",
]
