"""Parallel-aware building blocks shared by all model families."""

from .attention import Attention, attention_core
from .block import TransformerBlock
from .embedding import LearnedPositionEmbedding, RotaryEmbedding, apply_rotary
from .loss import IGNORE_INDEX, causal_lm_loss, shift_labels
from .masks import build_attention_mask
from .mlp import MLP
from .norms import RMSNorm, build_norm
from .embedding import EmbeddingNorm, padding_aware_position_ids
from .heads import MaskedLMHead, Pooler
from .masks import additive_mask
from .position_bias import RelativePositionBias, relative_position_bucket

__all__ = [
    "Attention", "attention_core", "TransformerBlock", "LearnedPositionEmbedding", "RotaryEmbedding",
    "apply_rotary", "IGNORE_INDEX", "causal_lm_loss", "shift_labels", "build_attention_mask", "MLP", "RMSNorm", "build_norm",
    "EmbeddingNorm", "padding_aware_position_ids", "MaskedLMHead", "Pooler",
    "additive_mask", "RelativePositionBias", "relative_position_bucket",
]
