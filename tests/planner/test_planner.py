"""auto_parallel planner: exact parameter counts, activation estimates against autograd's saved tensors, monotone
and sensible estimates, invalid layouts excluded, a memory budget forcing ZeRO/recompute, a readable explanation."""

import logging

import pytest
import torch

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig, RecomputeConfig
from mindformers_py.planner.search import (
    GIB,
    DeviceSpec,
    ModelShape,
    auto_parallel,
    estimate_memory,
    estimate_step_time,
    host_available_memory,
    parse_bytes,
    plan,
)
from mindformers_py.parallel.recompute import apply_recompute

GPU = DeviceSpec(device_type="cuda", memory_bytes=80 * GIB, flops=400e12, intra_node_bandwidth=200e9,
                 inter_node_bandwidth=25e9, devices_per_node=8, micro_batch_overhead_s=2e-4)


def tiny(flavour="gpt2", **kw):
    cfg = dict(flavour=flavour, vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=64, use_cache=False)
    return mf.GPTConfig(**{**cfg, **kw})


# Multi-head latent attention at a tiny width (query/key heads of 24, value heads of 12).
MLA = dict(attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def llama_7b():
    return mf.GPTConfig(flavour="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                        num_attention_heads=32, intermediate_size=11008, max_position_embeddings=4096)


def layout(dp=1, tp=1, pp=1, **fields):
    mode = "stand_alone" if dp * tp * pp == 1 else "semi_auto_parallel"
    return ParallelConfig(parallel_mode=mode, data_parallel=dp, model_parallel=tp, pipeline_stage=pp,
                          micro_batch_num=fields.pop("micro_batch_num", max(pp, 1)), **fields)


def saved_activation_bytes(model, ids):
    """Bytes of the distinct non-parameter tensors autograd saves in one forward (the benchmark's measure)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids).loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("kw", [dict(flavour="gpt2"), dict(flavour="llama", num_key_value_heads=2),
                                dict(flavour="llama", tie_word_embeddings=True, attention_bias=True),
                                dict(flavour="llama", qk_norm=True, attention_bias=True, attention_out_bias=True),
                                *[dict(flavour="llama", **MLA, q_lora_rank=q) for q in (32, None)]])
def test_parameter_count_is_exact(kw):
    cfg = tiny(**kw)
    with torch.device("meta"):
        model = mf.GPTForCausalLM(cfg)
    assert ModelShape.from_config(cfg).total_params() == model.num_parameters()
    assert estimate_memory(cfg, layout(), 1, 8).parameters == 4 * model.num_parameters()


@pytest.mark.parametrize("q_rank", [32, None])
@pytest.mark.parametrize("recompute", [False, "full"])
def test_latent_attention_activation_estimate_matches_saved_tensors(q_rank, recompute):
    """The latents (the query's and the keys' and values', normed) and the shared rope key, whole on every rank,
    beside q, k and v expanded per head; SDPA on the CPU runs its math path when the value heads are narrower than
    the query/key heads, keeping the attention probabilities (``attention_scores``)."""
    cfg = tiny("llama", **MLA, q_lora_rank=q_rank)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(cfg).train()
    apply_recompute(model, RecomputeConfig(recompute=recompute))
    measured = saved_activation_bytes(model, torch.randint(0, 256, (2, 64)))
    estimated = estimate_memory(cfg, layout(recompute=recompute), 2, 64, attention_scores=True).activations
    assert estimated == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("flavour", ["gpt2", "llama", "qwen3"])
@pytest.mark.parametrize("recompute", [False, "full", "selective"])
def test_activation_estimate_matches_saved_tensors(flavour, recompute):
    cfg = tiny("llama", qk_norm=True) if flavour == "qwen3" else tiny(flavour)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(cfg).train()
    apply_recompute(model, RecomputeConfig(recompute=recompute))
    measured = saved_activation_bytes(model, torch.randint(0, 256, (2, 64)))
    estimated = estimate_memory(cfg, layout(recompute=recompute), 2, 64).activations
    assert estimated == pytest.approx(measured, rel=0.02)


def test_memory_falls_with_sharding_recompute_and_model_parallelism():
    cfg, batch, seq = llama_7b(), 4, 4096
    mem = {z: estimate_memory(cfg, layout(dp=8, optimizer_shard=z), batch, seq) for z in (0, 1, 2, 3)}
    assert mem[1].optimizer == mem[0].optimizer // 8 and mem[1].gradients == mem[0].gradients
    assert mem[2].gradients == mem[0].gradients // 8
    assert mem[3].parameters < mem[0].parameters / 4
    assert mem[0].total > mem[1].total > mem[3].total
    plain = estimate_memory(cfg, layout(), batch, seq).activations
    full = estimate_memory(cfg, layout(recompute="full"), batch, seq)
    assert full.activations < plain / 4 and full.recompute > 0
    tp = [estimate_memory(cfg, layout(tp=t), batch, seq) for t in (1, 2, 4, 8)]
    assert all(a.parameters > b.parameters and a.activations > b.activations for a, b in zip(tp, tp[1:]))
    seq_parallel = estimate_memory(cfg, layout(tp=4, use_seq_parallel=True), batch, seq)
    assert seq_parallel.activations < tp[2].activations
    pp = estimate_memory(cfg, layout(pp=4, micro_batch_num=4), batch, seq)
    assert pp.parameters < tp[0].parameters / 3  # a quarter of the layers (plus the embedding or the head)
    gpipe = estimate_memory(cfg, layout(pp=2, micro_batch_num=4, pipeline_schedule="gpipe"), batch, seq)
    one_f_one_b = estimate_memory(cfg, layout(pp=2, micro_batch_num=4), batch, seq)
    assert gpipe.activations > one_f_one_b.activations  # GPipe keeps every micro-batch in flight


def test_zero3_counts_its_largest_unit_gathered_and_every_estimate_the_runtime():
    """At a peak under ZeRO-3 FSDP2 holds the largest unit it gathers twice (the all-gather buffer and the parameter
    copied out of it); at a 32K vocabulary and width 64 that unit is the output head, not a layer (counting two layers
    left a 1B model's ZeRO-3 rank 48% under its measured peak). The process's runtime is counted on the CPU."""
    cfg = tiny("llama", vocab_size=32000, num_key_value_heads=2)
    shape = ModelShape.from_config(cfg)
    unit = shape.head_params()  # the untied head: the final norm and 32000 x 64
    assert unit > shape.embedding_params() > 2 * shape.layer_params()
    zero3 = estimate_memory(cfg, layout(dp=2, optimizer_shard=3), 1, 8)
    assert zero3.parameters == 4 * shape.total_params() // 2 + 2 * 4 * unit  # fp32 shards + the head gathered, twice
    plain = estimate_memory(cfg, layout(), 1, 8)
    assert estimate_memory(cfg, layout(), 1, 8, runtime_bytes=GIB).total == plain.total + GIB
    cpu = DeviceSpec.detect("cpu")
    assert cpu.runtime_bytes > GIB // 2  # measured 0.57 GiB for a CPU training process
    assert plan(cfg, 1, 1, 8, device=cpu).chosen.memory.runtime == cpu.runtime_bytes


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s first byte (``/proc/self/maps``), or None for anonymous memory."""
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else None
    return None


def test_a_frozen_file_mapped_embedding_counts_only_the_rows_a_step_looks_up(tmp_path):
    """On CPU the loader keeps a checkpoint's weights as views of the mapped safetensors file, so an adapter run's
    frozen input embedding is resident only for the rows its steps read (measured: a Qwen3-MoE slice's LoRA run sat
    at 5.95 GiB with 0.56 GiB of its 0.58 GiB table never read, which the estimate counted whole). The planner counts
    it so on a device that maps frozen weights, and whole where ZeRO-3 or tensor parallelism reads the table into
    memory, the head is the same table or the embedding trains."""
    import transformers

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        tie_word_embeddings=False))
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    embedding = ours.get_input_embeddings().weight
    assert _mapped_file(embedding) is not None and _mapped_file(embedding).startswith(str(tmp_path))

    cfg, tokens = tiny("llama", vocab_size=32000, num_key_value_heads=2), 8
    unread = (32000 - tokens) * 64 * 4  # fp32 rows no step reads

    def saving(parallel, config=cfg, trainable=1000):
        whole = estimate_memory(config, parallel, 1, tokens, trainable_params=trainable)
        mapped = estimate_memory(config, parallel, 1, tokens, trainable_params=trainable, mapped_embedding=True)
        return whole.total - mapped.total

    assert saving(layout()) == unread
    assert saving(layout(dp=2, optimizer_shard=1)) == unread
    assert saving(layout(pp=2)) == 0  # the busiest stage is the last, with the head; the first holds the table
    assert saving(layout(dp=2, optimizer_shard=3)) == 0  # FSDP2 copies its shard of the table
    assert saving(layout(tp=2)) == 0  # a DTensor's local part is read out of the file
    assert saving(layout(), trainable=None) == 0  # full fine-tuning updates every row
    assert saving(layout(), tiny("llama", vocab_size=32000, tie_word_embeddings=True)) == 0  # the head reads it all
    assert DeviceSpec.detect("cpu").maps_frozen_weights and not GPU.maps_frozen_weights


def test_activations_grow_with_batch_and_sequence():
    cfg = tiny()
    base = estimate_memory(cfg, layout(), 2, 32).activations
    assert estimate_memory(cfg, layout(), 4, 32).activations == pytest.approx(2 * base, rel=0.01)
    assert estimate_memory(cfg, layout(), 2, 64).activations == pytest.approx(2 * base, rel=0.01)


def test_step_time_terms_behave():
    cfg, batch, seq = llama_7b(), 8, 2048
    one = estimate_step_time(cfg, layout(), batch, seq, GPU)
    assert one.tensor_parallel == one.data_parallel == one.bubble == 0
    tp = estimate_step_time(cfg, layout(tp=2), batch, seq, GPU)
    # The layers halve; the LM head stays whole on each rank unless the vocabulary is sharded too.
    assert one.compute / 2 < tp.compute < one.compute / 2 * 1.05 and tp.tensor_parallel > 0
    vocab = estimate_step_time(cfg, layout(tp=2, vocab_emb_dp=False), batch, seq, GPU)
    assert vocab.compute == pytest.approx(one.compute / 2)
    dp = estimate_step_time(cfg, layout(dp=2), batch, seq, GPU)
    assert dp.compute == pytest.approx(one.compute) and dp.data_parallel > 0  # twice the samples on two ranks
    zero3 = estimate_step_time(cfg, layout(dp=2, optimizer_shard=3), batch, seq, GPU)
    assert zero3.data_parallel > dp.data_parallel
    bubbles = [estimate_step_time(cfg, layout(pp=4, micro_batch_num=m), batch, seq, GPU).bubble for m in (4, 8)]
    assert bubbles[0] > bubbles[1] > 0
    interleaved = estimate_step_time(cfg, layout(pp=4, micro_batch_num=8, pipeline_schedule="interleaved_1f1b",
                                                 virtual_pipeline_stages=2), batch, seq, GPU)
    assert interleaved.bubble == pytest.approx(bubbles[1] / 2)
    recomputed = estimate_step_time(cfg, layout(recompute="full"), batch, seq, GPU)
    assert recomputed.compute == pytest.approx(one.compute * 4 / 3, rel=0.1)


def test_invalid_layouts_are_excluded_with_the_reason():
    cfg = tiny(num_attention_heads=2, num_hidden_layers=2)  # tp 4 cannot split 2 heads; pp 4 has too few layers
    result = plan(cfg, 4, 4, 32, device=DeviceSpec(memory_bytes=GIB, devices_per_node=4))
    layouts = {c.layout for c in result.candidates}
    assert layouts == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}
    reasons = dict(result.excluded)
    assert "model_parallel=4" in reasons["dp=1 tp=4 pp=1"]
    assert "num_hidden_layers=2" in reasons["dp=1 tp=1 pp=4"]
    for est in result.candidates:
        est.config.validate_for(4, cfg, per_device_batch=4)
    narrow = plan(cfg, 4, 4, 32, device=DeviceSpec(memory_bytes=GIB, devices_per_node=1))
    assert all(c.config.tp == 1 for c in narrow.candidates)  # tensor parallelism stays within a node
    by_batch = plan(cfg, 4, None, 32, global_batch=2, device=DeviceSpec(memory_bytes=GIB, devices_per_node=4))
    assert all(c.config.dp <= 2 for c in by_batch.candidates)
    with pytest.raises(ConfigError, match="no valid layout for world_size=3"):
        plan(cfg, 3, None, 32, global_batch=2, device=DeviceSpec(memory_bytes=GIB, devices_per_node=3))


def test_roomy_memory_keeps_what_was_asked_and_picks_data_parallel_for_a_small_model():
    result = plan(mf.AutoConfig.from_pretrained("gpt_small"), 8, 8, 1024, device=GPU)
    assert result.chosen.layout == (8, 1, 1) and result.chosen.changes == 0
    assert result.config.parallel_mode == "semi_auto_parallel" and result.config.data_parallel == 8


def test_a_memory_budget_forces_sharding_or_recompute():
    cfg = llama_7b()
    roomy = plan(cfg, 8, 4, 4096, device=GPU)
    tight_device = DeviceSpec(**{**GPU.__dict__, "memory_bytes": 24 * GIB})
    tight = plan(cfg, 8, 4, 4096, device=tight_device)
    assert tight.chosen.fits and tight.chosen.memory.total <= tight_device.usable_bytes
    assert tight.chosen.memory.total < roomy.chosen.memory.total
    chosen = tight.config
    assert chosen.zero_stage > 0 or chosen.recompute.enabled or chosen.tp * chosen.pp >= 4
    # The same layout as the roomy choice would not fit the tight budget without the extra saving.
    plain = estimate_memory(cfg, roomy.config, 4, 4096)
    assert plain.total > tight_device.usable_bytes
    with pytest.raises(ConfigError, match="no layout that fits memory_budget=1.00 GiB"):
        plan(cfg, 8, 4, 4096, device=DeviceSpec(**{**GPU.__dict__, "memory_bytes": GIB}))


def test_budget_on_one_rank_turns_on_recompute():
    cfg = tiny()
    free = estimate_memory(cfg, layout(), 8, 64).total
    device = DeviceSpec(memory_bytes=int(free * 0.8), headroom=0.0, devices_per_node=1)
    result = plan(cfg, 1, 8, 64, device=device)
    assert result.config.recompute.recompute in ("full", "selective") and result.chosen.fits


def test_explanation_table_names_the_choice(caplog):
    base = ParallelConfig(parallel_mode="auto_parallel", pipeline_schedule="gpipe")
    with caplog.at_level(logging.INFO, logger="mindformers_py.planner.search"):
        config = auto_parallel(base, llama_7b(), 8, 4, 4096, device=GPU)
    text = caplog.text
    chosen_rows = [line for line in text.splitlines() if line.rstrip().endswith("<- chosen")]
    assert len(chosen_rows) == 1
    described = chosen_rows[0].split("  ")[0]
    assert described.startswith(f"dp={config.data_parallel} tp={config.model_parallel} pp={config.pipeline_stage}")
    assert f"chose {described}" in text and "samples/s" in text and "excluded" in text
    assert config.parallel_mode == "semi_auto_parallel" and config.pipeline_schedule == "gpipe"
    config.validate_for(8, llama_7b(), per_device_batch=4)
    untouched = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=2)
    assert auto_parallel(untouched, llama_7b(), 2, 4) is untouched


def test_device_detection_and_budgets(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert host_available_memory(str(meminfo)) == 8000000 * 1024
    assert host_available_memory(str(tmp_path / "missing")) is None
    assert parse_bytes("6GiB") == 6 * GIB and parse_bytes("512 MB") == 512 * 1000**2 and parse_bytes(1024) == 1024
    with pytest.raises(ConfigError, match="memory_budget='lots'"):
        parse_bytes("lots")
    spec = DeviceSpec.detect("cpu", memory_budget="2GiB", world_size=4)
    assert spec.memory_bytes == 2 * GIB and spec.devices_per_node == 4 and spec.usable_bytes < 2 * GIB
    assert DeviceSpec.detect("cpu", world_size=2).memory_bytes > 0


def _plan_on_ranks(rank, world_size):
    # Rank 1 sees far less memory; the job must still run rank 0's layout everywhere.
    device = DeviceSpec(memory_bytes=GIB if rank == 0 else 1024, devices_per_node=2)
    config = auto_parallel(ParallelConfig(parallel_mode="auto_parallel"), tiny(), world_size, 4, 64, device=device)
    return config.to_dict()


def test_ranks_of_a_job_run_rank_zeros_plan():
    from support.dist_utils import run_workers

    first, second = run_workers(_plan_on_ranks, 2)
    assert first == second and first["parallel_mode"] == "semi_auto_parallel"
    assert first["data_parallel"] * first["model_parallel"] * first["pipeline_stage"] == 2


def test_fused_loss_counts_one_chunk_of_logits_where_the_head_can_be_fused():
    """``fused_loss``: the model folds its head into the loss (no whole logits, nor their gradient) where the head is
    whole on its rank, sharded over the vocabulary by tensor parallelism (a vocabulary-parallel loss) or, frozen (an
    adapter's run), gathered by ZeRO-2/3 for the loss alone; the estimate drops by those terms there, and not under
    pipeline stages (the schedule takes the loss from the logits), ZeRO-2/3 with the head trained (its gradient
    hooks would not run) or ZeRO-3 over a vocabulary-parallel head."""
    cfg, batch, seq = tiny("llama", vocab_size=32000, num_key_value_heads=2), 4, 256

    def saving(parallel, trainable=None):
        plain = estimate_memory(cfg, parallel, batch, seq, trainable_params=trainable)
        fused = estimate_memory(cfg, parallel, batch, seq, trainable_params=trainable, fused_loss=True)
        return plain.total - fused.total

    whole_logits = batch * seq * 32000 * 4
    assert saving(ParallelConfig()) > 1.5 * whole_logits  # the log-softmax and the logits' gradient
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2)) > 1.5 * whole_logits
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2), trainable=1000) > 1.5 * whole_logits
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=3)) == 0
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=3), trainable=1000) \
        > 1.5 * whole_logits
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=2)) == 0
    assert saving(ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=2), trainable=1000) \
        > 1.5 * whole_logits
    vocab_tp2 = dict(parallel_mode="semi_auto_parallel", model_parallel=2, vocab_emb_dp=False)
    assert saving(ParallelConfig(**vocab_tp2)) > 1.5 * whole_logits / 2  # each rank's half of the vocabulary
    assert saving(ParallelConfig(**vocab_tp2, data_parallel=2)) > 1.5 * whole_logits / 2
    assert saving(ParallelConfig(**vocab_tp2, data_parallel=2, optimizer_shard=3), trainable=1000) == 0
    assert saving(ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=2)) == 0


def test_a_frozen_head_split_over_data_parallel_ranks_counts_its_rows_and_the_gathered_tokens():
    """``shard_frozen_head`` in an adapter's run: each of the dp ranks holds 1/dp of the head's rows; fused, it keeps
    every rank's hidden states and their gradient instead of its own (a chunk of its own columns); unfused, its
    forward gathers the whole weight. A trained head (no adapter) or a tied one is not split."""
    cfg, batch, seq = tiny("llama", vocab_size=32000, num_key_value_heads=2), 4, 256
    dp2 = dict(parallel_mode="data_parallel", data_parallel=2)

    def estimate(shard: bool, fused: bool = True, trainable: int | None = 1000, model=cfg) -> int:
        return estimate_memory(model, ParallelConfig(**dp2, shard_frozen_head=shard), batch, seq, param_bytes=2,
                               trainable_params=trainable, fused_loss=fused).total

    head, hidden_states = 32000 * 64 * 2, batch * seq * 64 * 4
    # (within 1%: the adapter's gradient and optimizer state are counted as a share of the parameters held)
    saved = head // 2 - 3 * hidden_states  # half the rows, less every rank's hidden states and their gradient
    assert estimate(False) - estimate(True) == pytest.approx(saved, rel=0.01)
    assert estimate(True, fused=False) - estimate(False, fused=False) == pytest.approx(head // 2, rel=0.01)
    assert estimate(True, trainable=None) == estimate(False, trainable=None)
    tied = tiny("llama", vocab_size=32000, num_key_value_heads=2, tie_word_embeddings=True)
    assert estimate(True, model=tied) == estimate(False, model=tied)


def test_the_planner_splits_a_frozen_head_where_the_layout_allows_it():
    """Asked for with ``auto_parallel``, ``shard_frozen_head`` stays on in the planner's ZeRO-0 layouts without
    tensor or pipeline parallelism and is dropped from the others rather than ruling them out."""
    from mindformers_py.planner.search import plan

    base = ParallelConfig(parallel_mode="auto_parallel", shard_frozen_head=True)
    result = plan(tiny("llama", num_key_value_heads=2), 2, 4, 64, base=base, trainable_params=1000, fused_loss=True,
                  device=DeviceSpec(memory_bytes=64 * GIB))
    configs = [candidate.config for candidate in result.candidates]
    assert {c.model_parallel for c in configs} == {1, 2} and {c.pipeline_stage for c in configs} == {1, 2}
    for config in configs:
        allowed = config.model_parallel == 1 and config.pipeline_stage == 1 and config.optimizer_shard == 0
        assert config.shard_frozen_head == allowed, config.describe()
    assert any(c.shard_frozen_head for c in configs)
