"""Multi-token prediction (DeepSeek-V3 technical report, section 2.2): ``D`` sequential modules after the main
model, the ``k``-th predicting the token ``k + 1`` positions ahead of the main model's next token, whose loss
densifies the training signal. At inference they can be dropped (or used for speculative decoding).

Module ``k`` (1-based) at position ``i`` combines the previous depth's hidden state ``h^{k-1}_i`` (``h^0``: the main
model's last hidden states) with the embedding of token ``t_{i+k}``::

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])     # (2H -> H, no bias), paper eq. 21
    h^k  = block(h')                                            # one transformer block, causal, eq. 22
    P^k_{i+k+1} = softmax(head(shared_head.norm(h^k_i)))         # the main model's output head, eq. 23

and its loss is the cross-entropy of ``P^k`` against the labels shifted by ``k + 1``; the total is
``mtp_loss_weight / D · Σ_k L^k`` (eqs. 24-25). The embedding and the output head are the main model's (shared, not
copied); :func:`mtp_loss` computes the loss from the logits :class:`MultiTokenPrediction` returns.

Names follow DeepSeek-V3's checkpoints, where MTP module ``k`` is decoder layer ``model.layers.<L + k - 1>`` (``L`` =
``num_hidden_layers``): ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` are the same names here under
``layers.<k - 1>``; the block's own tensors (``self_attn.*``, ``mlp.*``, ``input_layernorm``,
``post_attention_layernorm``) sit directly under the checkpoint's layer and under ``block.`` here
(:func:`checkpoint_name` / :func:`module_name` convert); the checkpoint's ``embed_tokens.weight`` and
``shared_head.head.weight`` are copies of the main model's embedding and output head, which these modules share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .loss import IGNORE_INDEX, token_cross_entropy
from .norms import RMSNorm

BLOCK_PREFIX = "block."
SHARED_TENSORS = ("embed_tokens.weight", "shared_head.head.weight")
"""Tensors of a checkpoint's MTP layer that are the main model's (its embedding and output head), not the module's."""


class SharedHead(nn.Module):
    """The checkpoint's ``shared_head``: its own final norm ``norm``; the output head (``shared_head.head``) is the
    main model's, passed to :meth:`forward`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head(self.norm(hidden_states))


class MultiTokenPredictionLayer(nn.Module):
    """One MTP module: ``forward(hidden_states, next_embeds, head, **block_kwargs) -> (hidden, logits, extra)``.

    ``hidden_states`` (B, T, H): the previous depth's output (the main model's last hidden states, before its final
    norm, for the first module); ``next_embeds`` (B, T, H): the main model's embedding of the tokens one further
    ahead than at the previous depth (``t_{i+k}`` at position ``i`` for module ``k``); ``head``: the main model's
    output head. Returns this depth's hidden states (the next depth's input), its logits (B, T, V) predicting
    ``t_{i+k+1}`` at position ``i``, and what the block returned beside its hidden states (an MoE block's router
    statistics), or None. ``block_kwargs`` go to ``block`` as the decoder stack passes them to its layers
    (attention mask, position embeddings, ``token_mask`` ...).
    """

    def __init__(self, hidden_size: int, block: nn.Module, eps: float = 1e-6) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, next_embeds: torch.Tensor, head: nn.Module,
                **block_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        # embedding first, then hidden state: the order of DeepSeek-V3's eh_proj weights (its paper writes them
        # the other way round)
        combined = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden_states)], dim=-1))
        out = self.block(combined, **block_kwargs)
        hidden, extra = (out[0], out[1] if len(out) > 1 else None) if isinstance(out, tuple) else (out, None)
        return hidden, self.shared_head(hidden, head), extra


class MultiTokenPrediction(nn.Module):
    """``D`` MTP modules in sequence (``num_nextn_predict_layers`` in DeepSeek-V3's config), ``layers.<k - 1>``.

    ``block_factory(k)`` builds module ``k``'s transformer block (1-based; e.g. a decoder layer with index
    ``num_hidden_layers + k - 1``, as the checkpoint numbers it). ``forward(hidden_states, input_ids, embed, head,
    **block_kwargs)``: ``hidden_states`` (B, T, H) the main model's last hidden states before its final norm,
    ``input_ids`` (B, T) the main model's input, ``embed`` its input embedding and ``head`` its output head;
    returns ``(logits, extras)``: module ``k``'s logits (B, T, V) at index ``k - 1`` (position ``i`` predicting
    ``t_{i+k+1}``; the last ``k + 1`` positions predict nothing), and each block's extra output (an MoE block's
    router statistics, else None). :func:`mtp_loss` turns the logits and the main model's labels into the loss.

    Token ``t_{i+k}`` at the last ``k`` positions lies beyond the sequence; those positions are given the sequence's
    first tokens instead (``torch.roll``), which only later, target-less, positions can see through causal
    attention. The roll runs over the whole row: a rank holding chunks of the sequence (context parallelism) passes
    ``ahead_ids`` instead, the tokens each depth embeds at its positions (:func:`tokens_ahead`, made from the whole
    row before it was cut).
    """

    def __init__(self, hidden_size: int, num_layers: int, block_factory: Callable[[int], nn.Module],
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(hidden_size, block_factory(k), eps)
                                    for k in range(1, num_layers + 1))

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module, head: nn.Module,
                ahead_ids: torch.Tensor | None = None, **block_kwargs: Any) -> tuple[list[torch.Tensor], list[Any]]:
        """``ahead_ids`` (B, T, D): the tokens each depth embeds (see the class docstring); None: from ``input_ids``."""
        if ahead_ids is None:
            ahead_ids = tokens_ahead(input_ids, len(self.layers))
        logits, extras = [], []
        for k, layer in enumerate(self.layers, start=1):
            ahead = ahead_ids[..., k - 1]  # t_{i+k} at position i
            hidden_states, depth_logits, extra = layer(hidden_states, embed(ahead), head, **block_kwargs)
            logits.append(depth_logits)
            extras.append(extra)
        return logits, extras


def tokens_ahead(input_ids: torch.Tensor, depths: int) -> torch.Tensor:
    """The tokens MTP modules ``1..depths`` embed at each position of ``input_ids`` (B, T): (B, T, depths), module
    ``k``'s at ``[..., k - 1]``, ``t_{i+k}`` at position ``i`` (the row's first tokens past its end, see
    :class:`MultiTokenPrediction`)."""
    return torch.stack([torch.roll(input_ids, shifts=-k, dims=-1) for k in range(1, depths + 1)], dim=-1)


def targets_ahead(labels: torch.Tensor, depths: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Every module's targets (:func:`mtp_targets`) of labels (B, T) aligned with the inputs: (B, T, depths), module
    ``k``'s at ``[..., k - 1]``; what a rank holding chunks of the sequence (context parallelism) is given, made
    from the whole row before it was cut (as the main loss's ``shift_labels``)."""
    return torch.stack([mtp_targets(labels, k, ignore_index) for k in range(1, depths + 1)], dim=-1)


def mtp_targets(labels: torch.Tensor, depth: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Module ``depth``'s targets from the main model's labels (B, T) (aligned with its inputs, as a causal LM's
    ``labels``): position ``i`` gets ``labels[i + depth + 1]``, the last ``depth + 1`` positions ``ignore_index``."""
    shift = depth + 1
    return torch.cat([labels[..., shift:], labels.new_full((*labels.shape[:-1], min(shift, labels.shape[-1])),
                                                           ignore_index)], dim=-1)


def mtp_loss(logits: list[torch.Tensor] | tuple[torch.Tensor, ...], labels: torch.Tensor | None, weight: float,
             num_items_in_batch: int | torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
             targets: torch.Tensor | None = None) -> torch.Tensor:
    """The MTP loss ``weight / D · Σ_k CE(logits[k - 1], mtp_targets(labels, k))`` (DeepSeek-V3 eqs. 24-25;
    ``weight`` is its ``λ``, a model config's ``mtp_loss_weight``: 0.3 early in DeepSeek-V3's training, then 0.1).

    Each depth's cross-entropy is a mean over its positions with a target (``ignore_index`` elsewhere), or, with
    ``num_items_in_batch`` (the main loss's items of the whole optimizer step), its sum over them divided by that,
    so micro-batch and data-parallel shares add up to the step's as the main loss's do. ``targets`` (B, T, D), when
    given, are every module's targets already aligned with the positions (:func:`targets_ahead`; ``labels`` is then
    not read): a rank holding chunks of the sequence cannot shift its labels across the chunks' edges."""
    if not logits:
        raise ValueError("mtp_loss needs the logits of at least one MTP module")
    if targets is None:
        targets = targets_ahead(labels, len(logits), ignore_index)
    total = sum(token_cross_entropy(depth_logits, targets[..., k - 1], num_items_in_batch, ignore_index=ignore_index)
                for k, depth_logits in enumerate(logits, start=1))
    return total * (weight / len(logits))


def checkpoint_name(name: str) -> str:
    """A DeepSeek-V3 checkpoint's name, relative to its MTP layer ``model.layers.<L + k - 1>.``, for the name of a
    tensor of :class:`MultiTokenPredictionLayer` (``block.self_attn.q_a_proj.weight`` ->
    ``self_attn.q_a_proj.weight``; ``enorm.weight`` stays)."""
    return name[len(BLOCK_PREFIX):] if name.startswith(BLOCK_PREFIX) else name


def module_name(name: str) -> str | None:
    """The inverse of :func:`checkpoint_name`: the :class:`MultiTokenPredictionLayer` tensor a checkpoint's MTP
    layer tensor loads into, or None for the copies of the main model's embedding and head (:data:`SHARED_TENSORS`)."""
    if name in SHARED_TENSORS:
        return None
    if name.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
        return name
    return BLOCK_PREFIX + name
