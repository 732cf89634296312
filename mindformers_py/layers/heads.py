"""Heads on top of an encoder: the first-token pooler (BERT, ViT) and the masked-language-modelling head (BERT,
RoBERTa).

Both are plain single-device modules; how tensor parallelism shards them is declared in the models' plans (the MLM
decoder is ``colwise_gather_output``: the vocabulary is split across ranks).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..errors import check_choice
from .norms import build_norm


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
        self.dropout = nn.Dropout(dropout)
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
