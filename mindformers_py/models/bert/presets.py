"""Named BERT presets, usable with ``AutoConfig.for_model`` / ``from_pretrained`` and listed by
``AutoConfig.show_support_list()``. Sizes follow Google's BERT release (Tiny/Mini/Small/Medium: Turc et al. 2019;
Base/Large: Devlin et al. 2019), RoBERTa-base and the MiniLM-L6-H384 encoder behind all-MiniLM-L6-v2."""

from __future__ import annotations

_BERT = dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)

BERT_PRESETS: dict[str, dict] = {
    "bert_tiny": dict(**_BERT, hidden_size=128, num_hidden_layers=2, num_attention_heads=2),
    "bert_mini": dict(**_BERT, hidden_size=256, num_hidden_layers=4, num_attention_heads=4),
    "bert_small": dict(**_BERT, hidden_size=512, num_hidden_layers=4, num_attention_heads=8),
    "bert_medium": dict(**_BERT, hidden_size=512, num_hidden_layers=8, num_attention_heads=8),
    "bert_base": dict(**_BERT, hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "bert_large": dict(**_BERT, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
    "minilm_l6": dict(**_BERT, hidden_size=384, num_hidden_layers=6, num_attention_heads=12),
    "roberta_base": dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, hidden_size=768,
                         num_hidden_layers=12, num_attention_heads=12, norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
                         eos_token_id=2, padded_positions=True, mlm_head_act="gelu", pooler_dropout=0.1),
}
