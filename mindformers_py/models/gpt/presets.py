"""Named GPT presets, usable with ``AutoConfig.for_model`` / ``from_pretrained`` and listed by
``AutoConfig.show_support_list()``. Sizes follow the published GPT-2, GPT-3 XL, Llama 3.2 1B, Qwen3 0.6B and 8B,
Mixtral 8x7B and Qwen3-30B-A3B shapes; the GPT-MoE presets route each token to 2 of 8 experts of half the dense MLP's
width, so they compute as many parameters per token as the dense preset of the same width (``gpt_moe_tiny`` beside
``llama_tiny``); ``qwen3_tiny`` and ``qwen3_moe_tiny`` are those two with Qwen3's per-head q/k norms (and Qwen3-MoE's
renormalised top-k, no shared expert); ``deepseek_v3_tiny`` is DeepSeek-V3's architecture in miniature (multi-head latent
attention, a dense first layer, then 16 routed experts in 4 groups behind the ``deepseek_v3`` router beside a shared
expert)."""

from __future__ import annotations

GPT_PRESETS: dict[str, dict] = {
    "gpt_tiny": dict(flavour="gpt2", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256),
    "gpt_small": dict(flavour="gpt2", vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=1024),
    "gpt_medium": dict(flavour="gpt2", vocab_size=50257, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=1024),
    "gpt_1.3b": dict(flavour="gpt2", vocab_size=50257, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=2048),
    "llama_tiny": dict(flavour="llama", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    "llama_1b": dict(
        flavour="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}
# Qwen3: the Llama flavour with per-head q/k norms, head_dim 128, rope theta 1e6 (the published config.json files).
_QWEN3 = dict(flavour="llama", qk_norm=True, vocab_size=151936, head_dim=128, max_position_embeddings=40960,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643,
              eos_token_id=151645)
GPT_PRESETS.update({
    "qwen3_tiny": dict(GPT_PRESETS["llama_tiny"], qk_norm=True),
    "qwen3_0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3_8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
})
# GPT-MoE: dropless top-2 routing with the load-balancing loss on (output_router_logits), as Mixtral trains.
_MOE_TOP2 = dict(expert_num=8, num_experts_chosen=2, routing_policy="dropless", aux_loss_factor=0.01)
GPT_PRESETS.update({
    "gpt_moe_tiny": dict(flavour="llama", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, output_router_logits=True,
                         moe_config=dict(_MOE_TOP2, moe_intermediate_size=384)),
    "gpt_moe_small": dict(flavour="llama", vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          max_position_embeddings=1024, output_router_logits=True,
                          moe_config=dict(_MOE_TOP2, moe_intermediate_size=1024)),
    "mixtral_8x7b": dict(flavour="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=32768, norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, output_router_logits=True,
                         moe_config=dict(_MOE_TOP2, aux_loss_factor=0.02)),
    "qwen3_moe_tiny": dict(flavour="llama", qk_norm=True, vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           output_router_logits=True, moe_config=dict(_MOE_TOP2, moe_intermediate_size=384)),
    # Qwen3-30B-A3B: top-8 of 128 experts of 768, renormalised, no shared expert, every layer routed
    "qwen3_30b_a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, output_router_logits=True,
                          moe_config=dict(expert_num=128, num_experts_chosen=8, moe_intermediate_size=768,
                                          routing_policy="dropless", norm_topk_prob=True, aux_loss_factor=0.001)),
})
# DeepSeek-V3 in miniature: its latent attention (the query and key/value latents, 2/3 and 1/4 of the width; heads of
# 32 + 16 rotary / 32 value dims, interleaved rotary pairs) and its MoE (a dense first layer, then top-4 of 16 experts
# of 128 from the best 2 of 4 groups, one shared expert, sigmoid scores scaled by 2.5, the sequence-wise balance loss).
GPT_PRESETS["deepseek_v3_tiny"] = dict(
    flavour="llama", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    max_position_embeddings=256, intermediate_size=768, attention_type="mla", q_lora_rank=160, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_interleave=True, output_router_logits=True,
    moe_config=dict(router_type="deepseek_v3", expert_num=16, num_experts_chosen=4, n_group=4, topk_group=2,
                    moe_intermediate_size=128, shared_expert_num=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    mlp_only_layers=[0], routing_policy="dropless", aux_loss_scope="sequence", aux_loss_factor=0.0001))
# No preset is called "gpt2": that name is GPT-2's repository on the Hugging Face Hub, whose weights it must load
# (models/hub.py), never a random model of its shape. gpt_small is that shape.
