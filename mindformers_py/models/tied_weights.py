"""Which of a model's weights are tied (one tensor under two names), by transformers' own declaration."""

from __future__ import annotations

from torch import nn


def tied_keys(model: nn.Module) -> dict[str, str]:
    """Tied weight key -> the key it shares its tensor with (``{"lm_head.weight": "model.embed_tokens.weight"}``),
    when the model's config ties them (``tie_word_embeddings``); saved once, under the second name."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return dict(tied) if isinstance(tied, dict) else {}
