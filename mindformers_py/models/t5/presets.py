"""Named T5 presets, usable with ``AutoConfig.for_model`` / ``from_pretrained`` and listed by
``AutoConfig.show_support_list()``. Sizes follow the published T5 (Raffel et al., 2020), T5 v1.1 / FLAN-T5 and mT5
shapes (transformers' configs of google-t5/t5-small, google/flan-t5-small, google/mt5-small, ...)."""

from __future__ import annotations

_V1 = dict(feed_forward_proj="relu", tie_word_embeddings=True)
_V1_1 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)

T5_PRESETS: dict[str, dict] = {
    "t5_tiny": dict(**_V1, vocab_size=8192, hidden_size=256, head_dim=64, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=4),
    "t5_small": dict(**_V1, vocab_size=32128, hidden_size=512, head_dim=64, intermediate_size=2048, num_hidden_layers=6,
                     num_attention_heads=8),
    "t5_base": dict(**_V1, vocab_size=32128, hidden_size=768, head_dim=64, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12),
    "t5_large": dict(**_V1, vocab_size=32128, hidden_size=1024, head_dim=64, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16),
    "t5_v1_1_tiny": dict(**_V1_1, vocab_size=8192, hidden_size=256, head_dim=64, intermediate_size=640,
                         num_hidden_layers=4, num_attention_heads=4),
    "flan_t5_small": dict(**_V1_1, vocab_size=32128, hidden_size=512, head_dim=64, intermediate_size=1024,
                          num_hidden_layers=8, num_attention_heads=6),
    "flan_t5_base": dict(**_V1_1, vocab_size=32128, hidden_size=768, head_dim=64, intermediate_size=2048,
                         num_hidden_layers=12, num_attention_heads=12),
    "mt5_small": dict(**_V1_1, vocab_size=250112, hidden_size=512, head_dim=64, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=6, scale_decoder_outputs=False, hf_architecture="mt5"),
}
# T5 v1.1 shares FLAN-T5's shapes.
T5_PRESETS["t5_v1_1_small"] = T5_PRESETS["flan_t5_small"]
