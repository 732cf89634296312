"""Every layout fills only its own shards: each rank builds the model on ``meta`` (``deferred_loading``), its engine
applies the layout, then reads only its parameters' slices from the checkpoint (or draws the inits of what the
checkpoint lacks, whole from each module's seed, then sliced). The weights each rank ends up holding are exactly the
stand-alone ones, and a sharding layout holds a fraction of them.

Two-rank layouts run in one spawn per checkpoint: ZeRO-3, ZeRO-2 and ZeRO-1 (DDP: filled before it starts), tp2 with
and without sequence parallelism, pp2, context parallel, ep2 (an MoE checkpoint); GPT-2's fused q/k/v (a derived
tensor, not only a slice) under tp2; a preset's random init and a new head's; dp2 x tp2 on four ranks."""

from __future__ import annotations

import pytest
import torch
import transformers

import mindformers_py as mf
from support.dist_utils import run_workers
from support.hf_models import tiny_deepseek_v3_config
from layout_loading_workers import load_sources_under_layouts, load_under_layouts

TWO_RANKS = {
    "zero3": dict(data_parallel=2, optimizer_shard=3),
    "zero2": dict(data_parallel=2, optimizer_shard=2),
    "zero1": dict(data_parallel=2, optimizer_shard=1),
    "tp2": dict(model_parallel=2),
    "tp2_sp": dict(model_parallel=2, use_seq_parallel=True),
    "pp2": dict(pipeline_stage=2),
    "cp2": dict(context_parallel=2),
}
# fraction of the whole model's values one rank may hold (pp2 and tp2 keep replicated norms and, for tp2, embeddings)
SHARDED = {"zero3": 0.55, "zero2": 0.55, "tp2": 0.9, "tp2_sp": 0.9, "pp2": 0.55}


def _checkpoint(tmp_path, kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                                                     n_positions=64, bos_token_id=0, eos_token_id=0))
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen3_moe":  # one tensor per expert and projection in the file, as transformers saves it
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4, num_experts_per_tok=2))
    else:  # deepseek_v3: latent attention, a dense first layer, 8 experts and a shared one, a non-zero expert bias
        model = transformers.DeepseekV3ForCausalLM(tiny_deepseek_v3_config())
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_()
    folder = tmp_path / kind
    model.save_pretrained(folder, max_shard_size="60KB")  # several shards: each rank reads across them
    return str(folder)


def _check(results, source: str, task: str, layouts, overrides=None, sharded=SHARDED) -> None:
    torch.manual_seed(0)  # the seed every rank loaded under: a preset's (or a new head's) init follows it
    reference = {k: v.detach() for k, v in
                 mf.auto.auto_class_for(task).from_pretrained(source, **(overrides or {})).named_parameters()}
    total = sum(v.numel() for v in reference.values())
    for name in layouts:
        for rank, per_rank in enumerate(results):
            weights, local, all_meta = per_rank[name][:3]
            assert all_meta, f"{name} rank {rank}: the model was not built on meta"
            assert weights, name
            for key, value in weights.items():
                assert torch.equal(value, reference[key]), f"{name} rank {rank}: {key} differs from stand-alone"
            if name in sharded:
                assert local <= sharded[name] * total, f"{name} rank {rank} holds {local} of {total} values"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_rank_reads_its_shards_of_an_hf_checkpoint_and_holds_the_stand_alone_weights(tmp_path, kind):
    folder = _checkpoint(tmp_path, kind)
    layouts = TWO_RANKS if kind == "llama" else {k: TWO_RANKS[k] for k in ("tp2", "tp2_sp", "zero3")}
    _check(run_workers(load_under_layouts, 2, folder, "causal_lm", layouts), folder, "causal_lm", layouts)


def test_a_frozen_models_row_shards_stay_views_of_the_mapped_file(tmp_path):
    """A frozen model (an adapter's base) under tp2 with the vocabulary sharded, and under dp2 with its head split
    over the ranks (``shard_frozen_head``): each rank's row shards stay views of the checkpoint's mapping, as a whole
    frozen table does, so the embedding rows no step looks up are never read; the values are stand-alone's. A
    trained model's shards are read into their own memory."""
    folder = _checkpoint(tmp_path, "llama")
    layouts = {"tp2_vocab_frozen": dict(model_parallel=2, vocab_emb_dp=False, frozen=True),
               "dp2_head_rows_frozen": dict(data_parallel=2, shard_frozen_head=True, frozen=True),
               "tp2_vocab": dict(model_parallel=2, vocab_emb_dp=False)}
    results = run_workers(load_under_layouts, 2, folder, "causal_lm", layouts)
    _check(results, folder, "causal_lm", layouts, sharded={"tp2_vocab_frozen": 0.55, "tp2_vocab": 0.55})
    for per_rank in results:
        mapped = per_rank["tp2_vocab_frozen"][4]
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"} <= mapped
        assert per_rank["dp2_head_rows_frozen"][4] == {"lm_head.weight"}
        assert per_rank["tp2_vocab"][4] == set()


def test_experts_are_read_by_the_ranks_that_hold_them(tmp_path):
    """Each expert-parallel rank holds, and reads from the file, only its own experts' tensors (the file keeps one
    tensor per expert; our model stacks them): Mixtral's, Qwen3-MoE's and DeepSeek-V3's checkpoints (the last with
    its dense first layer, shared expert and expert bias, read by both ranks), in one launch."""
    kinds = {"mixtral": 4, "qwen3_moe": 4, "deepseek_v3": 8}  # -> experts per layer
    folders = {kind: _checkpoint(tmp_path, kind) for kind in kinds}
    layouts = {"ep2": dict(data_parallel=2, expert_parallel=2),
               "ep2_zero3": dict(data_parallel=2, expert_parallel=2, optimizer_shard=3)}
    per_kind = run_workers(load_sources_under_layouts, 2, folders, "causal_lm", layouts)
    for kind, folder in folders.items():
        results = [ranks[kind] for ranks in per_kind]
        # ep2 holds every dense value and half the experts' (DeepSeek's tiny dense layer and latents weigh more)
        _check(results, folder, "causal_lm", layouts, sharded={"ep2": 0.8 if kind == "deepseek_v3" else 0.7,
                                                              "ep2_zero3": 0.55})
        for name in layouts:
            for rank, per_rank in enumerate(results):
                experts = {int(key.split(".experts.")[1].split(".")[0]) for key in per_rank[name][3]
                           if ".experts." in key}
                local = kinds[kind] // 2
                assert experts == set(range(local * rank, local * (rank + 1))), (kind, name, rank, experts)
                if kind == "deepseek_v3":
                    assert {k for k in per_rank[name][3] if k.endswith("e_score_correction_bias")} == {
                        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)}


def test_random_inits_are_the_same_under_every_layout(tmp_path):
    """A preset (every weight initialised) and a new classification head on a checkpoint: each module's init is
    drawn whole from its own seed and sliced, so every layout holds stand-alone's values."""
    layouts = {k: TWO_RANKS[k] for k in ("zero3", "tp2", "pp2")}
    overrides = {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2}
    _check(run_workers(load_under_layouts, 2, "llama_tiny", "causal_lm", layouts, overrides), "llama_tiny",
           "causal_lm", layouts, overrides)
    folder = _checkpoint(tmp_path, "llama")
    head = {"num_labels": 3}
    layouts = {k: TWO_RANKS[k] for k in ("zero3", "tp2")}
    _check(run_workers(load_under_layouts, 2, folder, "sequence_classification", layouts, head), folder,
           "sequence_classification", layouts, head)


def test_fsdp_over_tensor_parallel_shards_on_four_ranks(tmp_path):
    folder = _checkpoint(tmp_path, "llama")
    layouts = {"dp2_tp2_zero3": dict(data_parallel=2, model_parallel=2, optimizer_shard=3)}
    _check(run_workers(load_under_layouts, 4, folder, "causal_lm", layouts), folder, "causal_lm", layouts,
           sharded={"dp2_tp2_zero3": 0.4})
