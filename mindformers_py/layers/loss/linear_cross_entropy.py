"""Causal-LM loss without the full logits: a chunked linear + cross-entropy with its gradient made in the forward.

A causal LM's logits and their gradient are (tokens x vocabulary) each: for a 128k vocabulary and 16k tokens
that is 8 GiB in fp32, usually the largest tensors of a step. :class:`LinearCrossEntropy` walks the tokens in
chunks, turns each chunk's logits into ``softmax - one_hot`` in place and multiplies it straight into the
hidden-state and weight gradients, so only one chunk of logits ever exists and backward just scales two saved
gradients. The matrix products are the same three as the plain path. Its normalisation follows the other losses of
:mod:`.loss` (``num_items_in_batch``, -100 ignored); the Trainer applies it to a model from outside
(:class:`~mindformers_py.trainer.fused_loss.FusedCausalLMLoss`).
"""

from __future__ import annotations

from typing import Any

import torch

from .cross_entropy import IGNORE_INDEX, shift_labels


class LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(hidden @ weight.T + bias, targets)) / denominator`` over non-ignored targets.

    Gradients with respect to ``hidden``, ``weight`` and ``bias`` are computed in the forward pass, chunk by
    chunk, and scaled by the incoming gradient in backward. Under autocast the matrix products run in the
    autocast dtype and the softmax in fp32, as autocast would do for ``F.linear`` + ``F.cross_entropy``.

    Per chunk: one buffer receives the logits, becomes their log-softmax (the loss reads the targets' entries),
    then ``softmax - one_hot`` in place. The per-row weight (1/denominator, or 0 for an ignored target) is
    applied to the small operands of the two gradient products rather than to the chunk itself.

    Vocabulary-parallel (``group`` given: tensor parallelism's head, each rank holding the rows from ``vocab_start``
    of the weight and every token): each chunk's softmax is normalised over all ranks' rows (the rows' maxima and
    sums of exponentials are reduced over ``group``), the loss is every rank's, and the hidden states' gradient,
    a partial sum over each rank's rows, is summed over ``group``; the weight's gradient is this rank's rows'.
    ``whole_vocab`` is the vocabulary's whole size, so that every rank walks the tokens in chunks of the same size.

    With ``gather_tokens`` as well (a frozen head sharded over data-parallel ranks, which hold different tokens), each
    rank's tokens, targets and denominator are first gathered from every rank of ``group``, so that each rank scores
    every token against its rows; the loss is this rank's tokens' alone and the hidden states' gradient, summed over
    the ranks, is scattered back (each rank receives its own tokens'). No weight gradient is made in this mode.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, denominator: torch.Tensor, group: Any = None,
                vocab_start: int = 0, whole_vocab: int = 0, gather_tokens: bool = False) -> torch.Tensor:
        device_type = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        # Only the gradients asked for are made: a frozen head (LoRA, a frozen base) needs none for its weight,
        # which would be a (vocabulary x hidden) fp32 buffer.
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        if gather_tokens and (want_weight or want_bias):
            raise ValueError("a head sharded over data-parallel ranks (gather_tokens) must be frozen")
        need_grad = want_hidden or want_weight or want_bias
        own_tokens = hidden.shape[0]
        own = None  # (first, last) row of this rank's tokens among every rank's, when they are gathered
        if gather_tokens:
            hidden, targets, denominator, own = _gather_tokens(hidden, targets, denominator, group)
        tokens, vocab = hidden.shape[0], weight.shape[0]
        # the chunk follows the largest rank's rows: every rank walks the same chunks (their reductions pair up)
        columns = max(vocab, -(-whole_vocab // torch.distributed.get_world_size(group))) if group is not None else vocab
        with torch.autocast(device_type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.float() if bias is not None else None
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            # Accumulate the weight gradient in fp32 whatever the compute dtype (as autocast's mm backward would).
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
            grad_bias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) \
                if want_bias and bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            chunk = min(tokens, max(1, CHUNK_ELEMENTS // columns))
            logits_buf = torch.empty(chunk, vocab, dtype=torch.float32, device=hidden.device)
            # CPU's row-wise log-softmax may write over its input; elsewhere it gets its own buffer.
            logp_buf = logits_buf if device_type == "cpu" else torch.empty_like(logits_buf)
            row_weight_all = (targets != IGNORE_INDEX).to(torch.float32) / denominator.float()
            # the rows whose loss this rank returns: all, or its own tokens among every rank's
            loss_weight_all = row_weight_all
            if own is not None:
                loss_weight_all = torch.zeros_like(row_weight_all)
                loss_weight_all[own[0]:own[1]] = row_weight_all[own[0]:own[1]]
            # This rank's rows of the vocabulary (all of them without a group): each target's column in them, and
            # whether it is here at all
            local = targets - vocab_start
            held_all = (local >= 0) & (local < vocab)
            for start in range(0, tokens, chunk):
                stop = min(start + chunk, tokens)
                h = hidden[start:stop].to(compute_dtype)
                row_weight = row_weight_all[start:stop].unsqueeze(1)  # (n, 1)
                # ignored rows, and targets on other ranks' rows, point anywhere: weight 0 / not held
                index = torch.where(held_all[start:stop], local[start:stop], 0).unsqueeze(1)
                if compute_dtype == torch.float32:
                    logits = torch.mm(h, w.t(), out=logits_buf[:stop - start])
                else:
                    logits = logits_buf[:stop - start].copy_(h @ w.t())
                if b is not None:
                    logits += b
                if group is None:
                    logp = torch.log_softmax(logits, 1, out=logp_buf[:stop - start])
                    total -= (logp.gather(1, index) * row_weight).sum()
                    if not need_grad:
                        continue
                    g = logp.exp_()  # softmax
                    g.scatter_add_(1, index, torch.full_like(index, -1, dtype=g.dtype))  # - one_hot(target)
                else:
                    held = held_all[start:stop].unsqueeze(1)
                    g, row_loss = _softmax_over_ranks(logits, index, held, group)
                    total += (row_loss * loss_weight_all[start:stop]).sum()
                    if not need_grad:
                        continue
                    g.scatter_add_(1, index, -held.to(g.dtype))  # - one_hot(target), on the rank holding it
                g = g.to(compute_dtype)
                if grad_hidden is not None:
                    grad_hidden[start:stop] = (g @ w).mul_(row_weight).to(hidden.dtype)
                if grad_weight is not None:
                    weighted_h = h * row_weight.to(compute_dtype)
                    if compute_dtype == torch.float32:
                        grad_weight.addmm_(g.t(), weighted_h)
                    else:
                        grad_weight += (g.t() @ weighted_h).float()
                if grad_bias is not None:
                    grad_bias += (row_weight.t() @ g.float()).squeeze(0)
        if group is not None and grad_hidden is not None:  # every rank's rows' share of each token's gradient
            if own is None:
                torch.distributed.all_reduce(grad_hidden, group=group)
            else:  # ... summed and handed to the rank whose tokens they are
                grad_hidden = _scatter_tokens(grad_hidden, group)[:own_tokens]
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                                  grad_bias.to(bias.dtype) if grad_bias is not None else None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.saved_tensors
        # The usual upstream gradient is exactly 1 (loss.backward()); on CPU checking costs nothing and saves
        # a pass over the weight-sized gradient.
        if grad_output.device.type == "cpu" and float(grad_output) == 1.0:
            return (*grads, *_NO_GRADS)
        return (*(g * grad_output.to(g.dtype) if g is not None else None for g in grads), *_NO_GRADS)


_NO_GRADS = (None,) * 6
"""The gradients of :meth:`LinearCrossEntropy.forward`'s inputs after ``bias`` (targets, denominator and settings)."""


def _gather_tokens(hidden: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor,
                   group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Every rank of ``group``'s tokens (hidden states, targets, and each token's denominator: its rank's), each
    rank's block padded to the longest with ignored targets; and this rank's (first, last) row among them."""
    import torch.distributed as dist

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = torch.zeros(ranks, 2, dtype=torch.float64, device=hidden.device)
    counts[rank] = torch.tensor([hidden.shape[0], float(denominator)], dtype=torch.float64)
    dist.all_reduce(counts, group=group)  # (tokens, denominator) of every rank
    longest = int(counts[:, 0].max())
    mine = torch.cat([targets, targets.new_full((longest - targets.shape[0],), IGNORE_INDEX)])
    every_target = targets.new_empty(ranks * longest)
    dist.all_gather(list(every_target.chunk(ranks)), mine, group=group)
    padded = torch.cat([hidden, hidden.new_zeros(longest - hidden.shape[0], hidden.shape[1])])
    every_hidden = hidden.new_empty(ranks * longest, hidden.shape[1])
    dist.all_gather(list(every_hidden.chunk(ranks)), padded, group=group)  # (gloo's list form writes in place)
    denominators = counts[:, 1].to(torch.float32).repeat_interleave(longest)
    return every_hidden, every_target, denominators, (rank * longest, rank * longest + hidden.shape[0])


def _scatter_tokens(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's partial gradients of every rank's (padded) tokens, summed; this rank's block of the sum."""
    import torch.distributed as dist

    blocks = list(grad.chunk(dist.get_world_size(group)))
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, blocks, group=group)
    return out


def _softmax_over_ranks(logits: torch.Tensor, index: torch.Tensor, held: torch.Tensor,
                        group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of vocabulary-parallel logits (this rank's columns) turned, in place, into their softmax over every
    rank's columns; and each row's cross-entropy (``index``: the target's column here, where ``held``)."""
    import torch.distributed as dist

    peak = logits.amax(1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(peak)
    stats = torch.stack([torch.zeros_like(peak[:, 0]), (logits.gather(1, index) * held).squeeze(1)])
    stats[0] = logits.exp_().sum(1)
    dist.all_reduce(stats, group=group)  # (sum of exponentials, target's logit) over every rank's columns
    logits.div_(stats[0].unsqueeze(1))
    return logits, stats[0].log() - stats[1]


CHUNK_ELEMENTS = 2**26
"""Logits elements per chunk (256 MiB in fp32; 441 tokens at Qwen3's 151,936-token vocabulary). Every chunk reads
the whole head weight twice more (and with a trained head adds into its fp32 gradient), so the chunk is as large as
memory allows, on a CPU as on a GPU: on 2 CPU cores, 1024 bf16 tokens of width 2048 against a frozen head took
2.8 s in chunks of 2**23 elements (55 tokens), 1.3 s in chunks of 2**26 and 1.6 s unfused; larger chunks gained
nothing (``benchmarks/bench_loss_chunks.py``). Still a fraction of the unfused loss's logits, log-softmax and
gradient (3 x tokens x vocabulary in fp32)."""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch: int | torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         shift: bool = True) -> torch.Tensor:
    """Next-token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` (-100 ignored), without
    materialising the logits. Normalised by ``num_items_in_batch`` when given (gradient accumulation over the
    whole batch's tokens), else by the number of counted targets — HF's ``ForCausalLMLoss`` conventions."""
    targets, denominator = _targets(hidden, labels, num_items_in_batch, shift)
    hidden, weight, bias = _for_grad_mode(hidden, weight, bias)
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets, denominator)


def _targets(hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None,
             shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat next-token targets and the loss's denominator (``num_items_in_batch``, else the counted targets)."""
    targets = (shift_labels(labels) if shift else labels).reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        return targets, (targets != IGNORE_INDEX).sum().clamp(min=1)
    return targets, torch.as_tensor(num_items_in_batch, device=hidden.device)


def _for_grad_mode(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as they are, or detached where no gradient is being recorded (evaluation): the Function's forward
    sees its inputs' ``requires_grad``, not the grad mode, and would make a trained head's gradient in every
    no-grad call (at Qwen3's vocabulary a 1.2 GB fp32 buffer and two vocabulary-wide products: an evaluation
    under ep2 held 2.9 GiB a rank more, and took 3.4x as long)."""
    if torch.is_grad_enabled():
        return tensors
    return tuple(t.detach() if t is not None else None for t in tensors)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: Any, labels: torch.Tensor,
                                        num_items_in_batch: int | torch.Tensor | None = None, shift: bool = True,
                                        sequence_sharded: bool = False, gather_tokens: bool = False) -> torch.Tensor:
    """:func:`linear_cross_entropy` with a head sharded over the vocabulary: ``weight`` a DTensor split by rows
    (``Shard(0)``) over a 1-D mesh, no bias; the weight's gradient is this rank's rows' (a DTensor like the weight).

    Tensor parallelism's head: ``hidden`` is the whole sequence on every rank, or with ``sequence_sharded`` this
    rank's part of it (sequence parallelism: gathered here, and its gradient handed back as that part); the loss is
    the whole batch's on every rank. With ``gather_tokens``, a frozen head split over data-parallel ranks, which
    hold different tokens (``LinearCrossEntropy``'s ``gather_tokens``): every rank's tokens are scored against every
    rank's rows, and the loss and the hidden states' gradient are this rank's tokens', as with a whole head."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    if sequence_sharded:  # the whole sequence (its gradient, made whole on every rank, is cut back to this part)
        hidden = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(
            mesh, [Replicate()]).to_local()
    targets, denominator = _targets(hidden, labels, num_items_in_batch, shift)
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    hidden, local = _for_grad_mode(hidden, weight.to_local())
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), local, None, targets, denominator,
                                    mesh.get_group(), int(offset[0]), weight.shape[0], gather_tokens)


__all__ = ["LinearCrossEntropy", "linear_cross_entropy", "vocab_parallel_linear_cross_entropy"]
