"""The planner's model shapes read from HF config dicts of every family (exact parameter counts against
transformers' own models), and how mixtures of experts, encoders and encoder-decoders enter memory and time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig
from mindformers_py.planner.cost_model import estimate_memory
from mindformers_py.planner.device_spec import load_device
from mindformers_py.planner.shape_readers import SHAPE_READERS, register_shape_reader, shape_from_hf_dict
from mindformers_py.planner.step_time import Runtime, estimate_step_time

TINY = [
    ("MixtralConfig", "MixtralForCausalLM", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                 num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
                                                 vocab_size=1000)),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                                   shared_expert_intermediate_size=384, num_hidden_layers=4,
                                                   num_attention_heads=8, num_key_value_heads=2, num_experts=6,
                                                   decoder_sparse_step=2, mlp_only_layers=[3], vocab_size=1000)),
    ("BertConfig", "BertForMaskedLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=256, vocab_size=1000)),
    ("RobertaConfig", "RobertaForMaskedLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=256, vocab_size=1000)),
    ("T5Config", "T5ForConditionalGeneration", dict(d_model=128, d_kv=16, d_ff=256, num_layers=2,
                                                    num_decoder_layers=3, num_heads=4, vocab_size=1000)),
    ("MT5Config", "MT5ForConditionalGeneration", dict(d_model=128, d_kv=16, d_ff=256, num_layers=2, num_heads=4,
                                                      vocab_size=1000, feed_forward_proj="gated-gelu",
                                                      tie_word_embeddings=False)),
    ("ViTConfig", "ViTForImageClassification", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=256, image_size=64, patch_size=16,
                                                    num_labels=10)),
    ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=256, vocab_size=1000)),
    ("MistralConfig", "MistralForCausalLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=256, vocab_size=1000)),
    ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=256, vocab_size=1000)),
    ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=48,
                                             num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                             attention_bias=True)),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=48, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
                                                   mlp_only_layers=[3], vocab_size=1000)),
    # Latent attention with and without a query latent, a dense first layer, fine-grained and shared experts; the
    # multi-token prediction module transformers does not build is left out of both counts.
    *[("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=q_rank,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, vocab_size=1000,
        first_k_dense_replace=1, num_nextn_predict_layers=0)) for q_rank in (96, None)],
    ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, bos_token_id=0,
                                           eos_token_id=0)),
]


@pytest.mark.parametrize("config_name, model_name, kwargs", TINY,
                         ids=[f"{t[1]}{'' if t[2].get('q_lora_rank', 1) else '-no-q-latent'}" for t in TINY])
def test_parameter_count_equals_transformers(config_name, model_name, kwargs):
    config = getattr(transformers, config_name)(**kwargs)
    with torch.device("meta"):
        model = getattr(transformers, model_name)(config)
    assert shape_from_hf_dict(config.to_dict()).total_params() == model.num_parameters()


MIXTRAL = {"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vocab_size": 32000, "max_position_embeddings": 4096}
H100 = load_device("h100_80gb")


def layout(**fields):
    return ParallelConfig(parallel_mode="semi_auto_parallel", **fields)


def test_expert_parallelism_splits_expert_state_and_adds_all_to_all():
    shape = shape_from_hf_dict(MIXTRAL)
    dense_part = shape.total_params() - shape.expert_stack_params()
    one = estimate_memory(shape, layout(data_parallel=8), 2, 1024, act_bytes=2)
    four = estimate_memory(shape, layout(data_parallel=8, expert_parallel=4), 2, 1024, act_bytes=2)
    # Parameters held: everything vs the dense part and a quarter of the experts.
    assert one.parameters == 4 * shape.total_params()
    assert four.parameters == 4 * (dense_part + shape.expert_stack_params() // 4)
    # ZeRO shards expert optimizer state over the dp/ep = 2 ranks holding the same experts.
    zero = estimate_memory(shape, layout(data_parallel=8, expert_parallel=4, optimizer_shard=1), 2, 1024, act_bytes=2)
    assert zero.optimizer == 8 * dense_part // 8 + 8 * (shape.expert_stack_params() // 4) // 2
    t1 = estimate_step_time(shape, layout(data_parallel=8), 2, 1024, H100, act_bytes=2)
    t4 = estimate_step_time(shape, layout(data_parallel=8, expert_parallel=4), 2, 1024, H100, act_bytes=2)
    assert t1.expert_parallel == 0 < t4.expert_parallel
    # Each rank still computes its tokens' top-2 experts: the same matrix work, in fewer, larger products.
    assert t4.compute == pytest.approx(t1.compute, rel=0.05)


def test_moe_flops_count_the_routed_experts_only():
    shape = shape_from_hf_dict(MIXTRAL)
    dense = shape_from_hf_dict({**MIXTRAL, "model_type": "mistral"})  # the same model with one dense MLP
    routed = shape.flops_per_token(1024) - dense.flops_per_token(1024)
    # top-2 of the experts instead of one MLP, plus the router.
    assert routed == pytest.approx(6 * shape.layers * (3 * 1024 * 2048 + 1024 * 8))


def test_encoders_run_full_attention_and_decoders_skip_the_masked_half():
    bert = shape_from_hf_dict({"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 4,
                               "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522})
    causal = dataclasses.replace(bert, causal=True)
    long = 4096
    full = estimate_step_time(bert, layout(), 4, long, H100, act_bytes=2).compute
    half = estimate_step_time(causal, layout(), 4, long, H100, act_bytes=2).compute
    assert full > half
    materialized = estimate_step_time(causal, layout(), 4, long, H100, act_bytes=2,
                                      runtime=Runtime(attention="materialized"))
    assert materialized.memory_bound > estimate_step_time(causal, layout(), 4, long, H100, act_bytes=2).memory_bound


def test_encoder_decoder_layers_all_enter_the_pipeline():
    t5 = shape_from_hf_dict({"model_type": "t5", "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
                             "num_decoder_layers": 6, "num_heads": 8, "vocab_size": 32128})
    assert t5.total_layers == 12
    pp = estimate_memory(t5, layout(pipeline_stage=4, micro_batch_num=4), 8, 512)
    whole = estimate_memory(t5, layout(), 8, 512)
    assert pp.parameters < whole.parameters / 2


def test_a_family_plugs_in_by_registering_a_reader():
    assert {"mixtral", "qwen2_moe", "bert", "roberta", "t5", "mt5", "vit"} <= set(SHAPE_READERS)

    @register_shape_reader("toy_encoder")
    def toy(cfg):
        return dataclasses.replace(shape_from_hf_dict({**cfg, "model_type": "bert"}), model_type="toy_encoder")

    try:
        shape = shape_from_hf_dict({"model_type": "toy_encoder", "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 4})
        assert shape.model_type == "toy_encoder" and shape.layers == 2
    finally:
        SHAPE_READERS.pop("toy_encoder")
    with pytest.raises(ConfigError, match="model_type='toy_encoder' in config.json is not one the planner reads"):
        shape_from_hf_dict({"model_type": "toy_encoder"})


def test_multi_token_prediction_modules_are_a_layer_a_projection_and_three_norms_each():
    """DeepSeek-V3's MTP module (``model.layers.<num_hidden_layers>.*`` in its checkpoints): a layer of the stack's
    last kind (MoE), ``eh_proj`` (2·hidden -> hidden), ``enorm``, ``hnorm`` and ``shared_head.norm``; the embedding
    and the head are the model's. Its FLOPs run that layer, the projection and the head once more per token."""
    config = transformers.DeepseekV3Config(**TINY[-2][2] | {"num_nextn_predict_layers": 0})
    without = shape_from_hf_dict(config.to_dict())
    with_mtp = shape_from_hf_dict(config.to_dict() | {"num_nextn_predict_layers": 2})
    h = without.hidden
    moe_layer = without.attention_params() + 2 * h + without.moe_dense_params() + without.expert_params()
    assert with_mtp.total_params() - without.total_params() == 2 * (moe_layer + 2 * h * h + 3 * h)
    assert with_mtp.mtp_params(ep=2) - with_mtp.mtp_expert_params(ep=2) == with_mtp.mtp_params() - with_mtp.mtp_expert_params()
    extra = with_mtp.flops_per_token(128) - without.flops_per_token(128)
    per_module = without.attention_matmul_params() + 3 * h * (2 * without.routed_ffn + without.shared_expert_ffn) \
        + h * without.experts + 2 * h * h + without.vocab * h
    assert extra == pytest.approx(2 * (6 * per_module + 12 * without.score_width * 128))


def test_latent_attention_splits_its_heads_and_keeps_its_latents_whole_under_tensor_parallelism():
    shape = shape_from_hf_dict(transformers.DeepseekV3Config(**TINY[-3][2]).to_dict())
    whole = shape.hidden * (shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim) \
        + shape.q_lora_rank + shape.kv_lora_rank
    assert shape.attention_params(tp=1) - whole == 4 * (shape.attention_params(tp=4) - whole)
    assert shape.v_width == 4 * 24 and shape.q_width == 4 * 48 and shape.score_width == (4 * 24 + 4 * 48) / 2
