"""Pooling a sequence into one vector by its first (class) token: a dense layer and an activation on it, as the
poolers of BERT and ViT do (transformers' ``BertPooler``/``ViTPooler``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..errors import check_choice


class ClsPooler(nn.Module):
    """``act(dense(hidden_states[:, 0]))``: (B, T, C) -> (B, out_size)."""

    def __init__(self, hidden_size: int, out_size: int | None = None, act: str = "tanh") -> None:
        super().__init__()
        check_choice("pooler_act", act, sorted(ACT2FN.keys()))
        self.dense = nn.Linear(hidden_size, out_size or hidden_size)
        self.activation = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))
