"""Parallel-aware building blocks shared by all model families."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["Attention", "attention_core"], ".attention"),
    "TransformerBlock": ".block",
    **dict.fromkeys(["EmbeddingNorm", "LearnedPositionEmbedding", "RotaryEmbedding", "apply_rotary",
                     "padding_aware_position_ids"], ".embedding"),
    **dict.fromkeys(["IGNORE_INDEX", "causal_lm_loss", "shift_labels"], ".loss"),
    **dict.fromkeys(["additive_mask", "build_attention_mask"], ".masks"),
    "MLP": ".mlp",
    **dict.fromkeys(["RMSNorm", "build_norm"], ".norms"),
    **dict.fromkeys(["MaskedLMHead", "Pooler"], ".heads"),
    **dict.fromkeys(["RelativePositionBias", "relative_position_bucket"], ".position_bias"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
