"""Heads on top of an encoder or decoder: the first-token pooler (BERT, ViT), the masked-language-modelling head
(BERT, RoBERTa), the sequence summary of GPT-2's multiple-choice head, and the positions a language-model head
scores (:func:`kept_positions`). The models that put a head on a base
model for a task (``<Family>For<Task>``) are :mod:`mindformers_py.models.task_models`.

Both are plain single-device modules; how tensor parallelism shards them is declared in the models' plans (the MLM
decoder is ``colwise_gather_output``: the vocabulary is split across ranks).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..errors import check_choice
from .dropout import Dropout
from .norms import build_norm


def kept_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The hidden states a language-model head scores: transformers' ``slice_logits_to_keep``, copied into a fresh
    row-major tensor when the slice is a strided view.

    ``generate`` keeps the last position of its prompt (``logits_to_keep=1``): a view whose strides are the whole
    sequence's (``is_contiguous()`` even says True for one row), which ``F.linear`` runs as a batched ``matmul``
    copying the whole (vocabulary x hidden) weight. In bf16 on a CPU (torch 2.13) that took 5.4 s and 0.58 GiB for
    one token at Qwen3's vocabulary, against 0.04 s and nothing for the same row copied out (a few KB)."""
    from transformers.modeling_utils import slice_logits_to_keep

    kept = slice_logits_to_keep(hidden, logits_to_keep)
    if kept.stride() == _row_major_strides(kept.shape):
        return kept
    return kept.clone(memory_format=torch.contiguous_format)


def _row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class Pooler(nn.Module):
    """``act(dense(dropout(h[:, 0])))``: a sequence summarised by its first token ([CLS], <s>), as transformers'
    ``BertPooler``/``ViTPooler`` (tanh).

    ``out_size`` (default: ``hidden_size``) and ``act`` (a transformers ACT2FN name) are ViT's ``pooler_output_size``
    and ``pooler_act``; ``dropout`` before the dense layer is RoBERTa's classification head (``classifier.dense``);
    BERT's and ViT's poolers have none (0).
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0, out_size: int | None = None, act: str = "tanh") -> None:
        super().__init__()
        check_choice("pooler_act", act, sorted(ACT2FN.keys()))
        self.dropout = Dropout(dropout)
        self.dense = nn.Linear(hidden_size, out_size or hidden_size)
        self.activation = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, out_size)
        return self.activation(self.dense(self.dropout(hidden_states[:, 0])))


class MaskedLMHead(nn.Module):
    """Token scores over the vocabulary: ``decoder(norm(act(dense(h))))``.

    ``decoder`` carries the output bias (one per token) and usually shares its weight with the token embedding
    (the model ties them). ``act`` is a transformers ACT2FN name (BERT uses the model's ``hidden_act``, RoBERTa
    always the exact ``gelu``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, act: str = "gelu", eps: float = 1e-12,
                 norm_type: str = "layernorm") -> None:
        super().__init__()
        check_choice("mlm_head_act", act, sorted(ACT2FN.keys()))
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = ACT2FN[act]
        self.norm = build_norm(norm_type, hidden_size, eps)
        self.decoder = nn.Linear(hidden_size, vocab_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))


SUMMARY_TYPES = ("last", "first", "mean", "cls_index")


class SequenceSummary(nn.Module):
    """One vector per sequence, as transformers' GPT-2 ``SequenceSummary``: the last, first or a chosen token
    (``summary_type="cls_index"``: the token at ``cls_index``, the last one without it), or the mean of all; then
    dropout, an optional projection ``summary`` (to ``num_outputs``) and activation.

    Args:
        hidden_size: size of the hidden states.
        summary_type: ``"last"``, ``"first"``, ``"mean"`` or ``"cls_index"``.
        num_outputs: size of the ``summary`` projection; None for no projection.
        activation: a transformers ACT2FN name applied after it, or None.
        first_dropout: dropout before the projection.
        last_dropout: dropout after the activation.
    """

    def __init__(self, hidden_size: int, summary_type: str = "cls_index", num_outputs: int | None = None,
                 activation: str | None = None, first_dropout: float = 0.0, last_dropout: float = 0.0) -> None:
        super().__init__()
        check_choice("summary_type", summary_type, SUMMARY_TYPES)
        self.summary_type = summary_type
        self.summary = nn.Linear(hidden_size, num_outputs) if num_outputs else nn.Identity()
        self.activation = ACT2FN[activation] if activation else nn.Identity()
        self.first_dropout = Dropout(first_dropout)
        self.last_dropout = Dropout(last_dropout)

    def forward(self, hidden_states: torch.Tensor, cls_index: torch.Tensor | None = None) -> torch.Tensor:
        """(..., T, C) -> (..., outputs); ``cls_index`` (...) picks each sequence's token with ``"cls_index"``."""
        if self.summary_type == "last":
            output = hidden_states[..., -1, :]
        elif self.summary_type == "first":
            output = hidden_states[..., 0, :]
        elif self.summary_type == "mean":
            output = hidden_states.mean(dim=-2)
        else:
            if cls_index is None:
                cls_index = hidden_states.new_full(hidden_states.shape[:-2], hidden_states.shape[-2] - 1, dtype=torch.long)
            index = cls_index[..., None, None].expand(*cls_index.shape, 1, hidden_states.shape[-1])
            output = hidden_states.gather(-2, index).squeeze(-2)
        return self.last_dropout(self.activation(self.summary(self.first_dropout(output))))
