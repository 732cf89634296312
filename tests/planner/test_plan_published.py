"""The planner's time model checked on paper against published large training runs.

Every figure below is copied from its source, named beside it:

* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21
  (arXiv:2104.04473): Table 1 (model shapes, tensor/pipeline sizes, GPUs, batch, achieved TFLOP/s per GPU) and the
  layout studies of Figures 11 to 16. Their micro-batch sizes, virtual pipeline stages, DDP implementation and
  activation recompute come from the paper's reproduction scripts in NVIDIA/Megatron-LM, examples/sc21/
  (run_table_1.sh, run_figure_11.sh ... run_figure_16.sh). All models: vocabulary 51,200, sequence 2048,
  A100-80GB (312 TFLOP/s fp16 peak), DGX A100 nodes. The paper reports TFLOP/s with its Eq. (3),
  F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration, which counts the recomputed forward.
* torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP on 8 (Table 1) and 128 (Table 3)
  H100 GPUs (96 GB HBM2e at 2.4 TB/s, 500 W power limit, 400 Gb/s per GPU between hosts), local batch 2, selective
  activation checkpointing, no torch.compile: 5,762 and 5,605 tokens/s per GPU.
* Megatron-Core MoE README, NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md: Mixtral 8x7B bf16 training
  at 438 TFLOPS per GPU as of MCore v0.8, with that version's reference mapping: 64 H100 80GB (NVLink 4, 8x400 Gb/s
  InfiniBand), sequence 4096, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch 256, dropless all-to-all.
  Megatron-Core counts TFLOPS as 12·B·s·L·h²·((1 + g/a + s/h) + (f/h)·k·3/2 + V/(2·L·h)) (training.py,
  num_floating_point_operations: no recompute, grouped-query and SwiGLU terms).

Each software stack is described to the time model by a :class:`Runtime`: Megatron-LM 2021 materialises the
attention scores, fuses its elementwise kernels, splits cross-node pipeline transfers over the tensor-parallel
ranks and reduces fp16 gradients after the backward pass with its local DDP (torch DDP, which overlaps, for the
runs the script marks ``DDP=torch``).
"""

from __future__ import annotations

import pytest

from mindformers_py.parallel import ParallelConfig
from mindformers_py.planner.cost_model import estimate_memory
from mindformers_py.planner.device_spec import load_device
from mindformers_py.planner.model_shape import ModelShape
from mindformers_py.planner.shape_readers import shape_from_hf_dict
from mindformers_py.planner.search import plan
from mindformers_py.planner.step_time import Runtime, estimate_step_time

TOLERANCE = 0.15
SEQ = 2048
VOCAB = 51200
A100 = load_device("a100_80gb")

# Narayanan et al. 2021, Table 1: parameters (billion), attention heads, hidden size, layers, tensor-parallel size,
# pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s per GPU.
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# examples/sc21/run_table_1.sh, per model: micro-batch size (MBS), layers per virtual pipeline stage (None: not
# interleaved) and DDP implementation. Every run uses full ("uniform") activation recompute.
RUN_TABLE_1 = {
    1.7: (16, None, "torch"), 3.6: (16, None, "torch"), 7.5: (16, None, "torch"), 18.4: (8, None, "torch"),
    39.1: (4, None, "local"), 76.1: (2, 5, "local"), 145.6: (2, 5, "local"), 310.1: (1, 3, "local"),
    529.6: (1, 1, "local"), 1008.0: (1, None, "local"),
}


def megatron_gpt(hidden: int, heads: int, layers: int) -> ModelShape:
    """Megatron-LM's GPT of 2021: learned positions, LayerNorm and biases everywhere, GeLU with a 4h MLP, tied
    embeddings, dropout 0.1 on attention and hidden states."""
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=hidden // heads,
                      ffn=4 * hidden, vocab=VOCAB, max_positions=SEQ, gated_mlp=False, rope=False, rms_norm=False,
                      norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=True,
                      learned_positions=True, act_saved=1, dropout=True)


def megatron_2021(ddp: str = "local") -> Runtime:
    return Runtime(attention="materialized", kernels="fused", overlap_grad_reduce=ddp == "torch",
                   pipeline_scatter_gather=True, grad_bytes=2)


def eq3_flops(batch: int, layers: int, hidden: int) -> float:
    """The paper's Eq. (3): FLOPs of one iteration, recompute included."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def layout(dp: int, tp: int, pp: int, micro: int = 1, virtual: int = 1, recompute: object = "full",
           **fields: object) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=dp, model_parallel=tp, pipeline_stage=pp,
                          micro_batch_num=micro if pp > 1 else 1, virtual_pipeline_stages=virtual,
                          pipeline_schedule="interleaved_1f1b" if virtual > 1 else "1f1b", recompute=recompute,
                          vocab_emb_dp=tp == 1, **fields)


def published(row: tuple) -> tuple[ModelShape, ParallelConfig, int, int, Runtime]:
    """The run of one Table 1 row: shape, layout, sequences per data-parallel rank, micro-batch size, runtime."""
    params, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    micro_size, layers_per_virtual, ddp = RUN_TABLE_1[params]
    dp = gpus // (tp * pp)
    per_rank = batch // dp
    virtual = layers // pp // layers_per_virtual if layers_per_virtual else 1
    config = layout(dp, tp, pp, micro=per_rank // micro_size, virtual=virtual)
    return megatron_gpt(hidden, heads, layers), config, per_rank, micro_size, megatron_2021(ddp)


def achieved_tflops(row: tuple, seconds: float) -> float:
    params, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    return eq3_flops(batch, layers, hidden) / seconds / gpus / 1e12


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_table_1_throughput_within_15_percent(row):
    shape, config, per_rank, _, runtime = published(row)
    seconds = estimate_step_time(shape, config, per_rank, SEQ, A100, act_bytes=2, runtime=runtime).total
    assert achieved_tflops(row, seconds) == pytest.approx(row[-1], rel=TOLERANCE)


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_table_1_layout_fits_and_the_planner_finds_one_at_least_as_fast(row):
    shape, config, per_rank, micro_size, runtime = published(row)
    # Without pipeline stages Megatron accumulates gradients over micro-batches of MBS sequences, which a
    # ParallelConfig leaves to the trainer: the memory of one micro-batch, the time of the whole rank batch.
    memory_batch = per_rank if config.pp > 1 else micro_size
    memory = estimate_memory(shape, config, memory_batch, SEQ, act_bytes=2, attention_scores=True)
    assert memory.total <= A100.usable_bytes  # the published layout ran on 80 GB GPUs
    seconds = estimate_step_time(shape, config, per_rank, SEQ, A100, act_bytes=2, runtime=runtime).total
    result = plan(shape, row[6], seq_length=SEQ, global_batch=row[7], device=A100, act_bytes=2, runtime=runtime,
                  full_search=True)
    assert result.chosen.fits and result.chosen.time.total <= seconds
    assert result.chosen.config.tp <= A100.devices_per_node


def tflops_of(shape: ModelShape, config: ParallelConfig, batch: int, runtime: Runtime | None = None) -> float:
    """Estimated TFLOP/s per GPU (Eq. 3) of ``config`` on a global ``batch``."""
    per_rank = batch // config.dp
    seconds = estimate_step_time(shape, config, per_rank, SEQ, A100, act_bytes=2,
                                 runtime=runtime or megatron_2021()).total
    return eq3_flops(batch, shape.layers, shape.hidden) / seconds / (config.dp * config.tp * config.pp) / 1e12


@pytest.mark.parametrize("batch", [32, 128])
def test_tensor_parallelism_within_a_node_beats_tensor_parallelism_across_nodes(batch):
    # Figure 13 (run_figure_13.sh): 162.2B model (32 layers, hidden 20480, 128 heads) on 64 GPUs, t x p = 64,
    # micro-batch 1. The paper's best is t=8 (one node), p=8; larger t crosses nodes, larger p grows the bubble.
    shape = megatron_gpt(20480, 128, 32)
    speed = {t: tflops_of(shape, layout(1, t, 64 // t, micro=batch), batch) for t in (2, 4, 8, 16, 32)}
    assert max(speed, key=speed.get) == 8
    assert speed[8] > speed[16] > speed[32]


def test_throughput_falls_as_the_pipeline_grows_at_a_fixed_batch():
    # Figure 14 (run_figure_14.sh): 5.9B model (32 layers, hidden 3840, 32 heads), 64 GPUs, t=1, p x d = 64,
    # micro-batch 1, batch 512: throughput falls as p grows (the bubble (p-1)/m grows).
    shape = megatron_gpt(3840, 32, 32)
    speeds = [tflops_of(shape, layout(64 // p, 1, p, micro=512 // (64 // p)), 512) for p in (2, 4, 8, 16, 32)]
    assert all(a > b for a, b in zip(speeds, speeds[1:]))


def test_throughput_falls_as_tensor_parallelism_grows_at_a_fixed_batch():
    # Figure 15 (run_figure_15.sh): the same 5.9B model, p=1, t x d = 64: throughput falls as t grows (smaller
    # matrices, more all-reduces, across nodes beyond t=8).
    shape = megatron_gpt(3840, 32, 32)
    speeds = [tflops_of(shape, layout(64 // t, t, 1), 512) for t in (2, 4, 8, 16, 32)]
    assert all(a > b for a, b in zip(speeds, speeds[1:]))


def test_micro_batch_size_trades_kernel_size_against_the_bubble():
    # Figure 16 (run_figure_16.sh): 91B model (32 layers, hidden 15360, 128 heads), t=8, p=8, micro-batch 1..8,
    # batch 128 and 512. Larger micro-batches mean fewer of them and a larger bubble: throughput falls from a
    # micro-batch of 2 to 8, far more at batch 128 than at 512. (The paper's optimum is 2; the model, which
    # finds no efficiency gain in matrices of 2048 rows over 4096, puts it at 1, 4% ahead of 2.)
    shape = megatron_gpt(15360, 128, 32)

    def speed(batch: int, micro_size: int) -> float:
        return tflops_of(shape, layout(1, 8, 8, micro=batch // micro_size), batch)

    for batch in (128, 512):
        assert speed(batch, 2) > speed(batch, 4) > speed(batch, 8)
    assert speed(128, 8) / speed(128, 2) < speed(512, 8) / speed(512, 2) - 0.1


def test_pipeline_weak_scaling_needs_a_large_batch():
    # Figure 11 (run_figure_11.sh): t=8, hidden 20480, 128 heads, 3 layers per stage, p = 1..8 nodes: with batch
    # 8 throughput drops as p grows, with batch 128 it holds.
    def speed(batch: int, p: int) -> float:
        return tflops_of(megatron_gpt(20480, 128, 3 * p), layout(1, 8, p, micro=batch), batch)

    assert speed(8, 8) < 0.75 * speed(8, 2)
    assert speed(128, 8) > 0.9 * speed(128, 2)


def test_interleaved_schedule_helps_most_at_small_batches():
    # Figure 12 (run_figure_12.sh): 175B model (96 layers, hidden 12288, 96 heads), t=8, p=12, micro-batch 1,
    # batch 12..60; interleaving with 2 layers per virtual stage (v=4) beats the default schedule, by less as the
    # batch grows.
    shape = megatron_gpt(12288, 96, 96)
    gains = [tflops_of(shape, layout(1, 8, 12, micro=b, virtual=4), b) / tflops_of(shape, layout(1, 8, 12, micro=b), b)
             for b in (12, 24, 36, 48, 60)]
    assert all(g > 1 for g in gains)
    assert all(a > b for a, b in zip(gains, gains[1:]))


# torchtitan's Llama 3.1 8B (HF config of meta-llama/Llama-3.1-8B).
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False}


@pytest.mark.parametrize("gpus, published_tps", [(8, 5762), (128, 5605)])
def test_torchtitan_llama3_8b_fsdp_on_h100(gpus, published_tps):
    # FSDP (ZeRO-3) with bf16 parameters and fp32 reduction, eager PyTorch and SDPA: our runtime's defaults.
    # torchtitan's "selective op" checkpointing re-runs every second matrix product of a layer; the closest
    # setting here re-runs the attention block, about the same matrix work.
    device = load_device("h100_80gb", memory="96GiB", hbm_bandwidth=2.4e12)
    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=gpus, optimizer_shard=3,
                            recompute={"recompute": "selective", "select_recompute": ["self_attn"]})
    seq, local_batch = 8192, 2
    seconds = estimate_step_time(shape_from_hf_dict(LLAMA_31_8B), config, local_batch, seq, device, act_bytes=2).total
    assert local_batch * seq / seconds == pytest.approx(published_tps, rel=TOLERANCE)


MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768}


def test_megatron_core_mixtral_8x7b_on_h100():
    # Megatron-Core: fused kernels, flash attention, distributed optimizer (ZeRO-1) with its bf16 parameter
    # all-gather and the gradient reduction both overlapped, p2p overlapped by the interleaved schedule.
    shape = shape_from_hf_dict(MIXTRAL_8X7B)
    runtime = Runtime(kernels="fused", overlap_p2p=True, zero1_param_bytes=2, zero1_overlapped=True)
    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=16, pipeline_stage=4,
                            expert_parallel=8, micro_batch_num=16, pipeline_schedule="interleaved_1f1b",
                            virtual_pipeline_stages=8, optimizer_shard=1)
    batch, seq, gpus = 256, 4096, 64
    device = load_device("h100_80gb")
    seconds = estimate_step_time(shape, config, batch // 16, seq, device, act_bytes=2, runtime=runtime).total
    h, layers, f = 4096, 32, 14336
    flops = 12 * batch * seq * layers * h * h * ((1 + 8 / 32 + seq / h) + f / h * 2 * 1.5 + 32000 / (2 * layers * h))
    assert flops / seconds / gpus / 1e12 == pytest.approx(438, rel=TOLERANCE)
    assert estimate_memory(shape, config, batch // 16, seq, act_bytes=2).total <= device.usable_bytes


# DeepSeek-V3 technical report (arXiv:2412.19437): 671B parameters (37B active per token) plus a 14B multi-token
# prediction module; 2,048 H800 GPUs; 16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1
# data parallelism, no tensor parallelism; sequence 4K, the batch ramped to 15,360 sequences; 180K H800 GPU-hours
# per trillion tokens (§1 and §3.1-3.3, §4.2, Table 1). Its shape is transformers' DeepseekV3Config defaults.
DEEPSEEK_V3_GPU_HOURS_PER_TRILLION = 180e3
DEEPSEEK_V3_RUNTIME = Runtime(kernels="fused", overlap_p2p=True, zero1_param_bytes=2, zero1_overlapped=True)


def deepseek_v3_published_step():
    """The planner's step for DeepSeek-V3 on its published layout, and the step the published figure implies."""
    import transformers

    shape = shape_from_hf_dict(transformers.DeepseekV3Config().to_dict())
    gpus, dp, batch, seq = 2048, 128, 15360, 4096
    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=dp, pipeline_stage=16,
                            expert_parallel=64, micro_batch_num=batch // dp, optimizer_shard=1)
    estimate = estimate_step_time(shape, config, batch // dp, seq, load_device("h800_80gb"), act_bytes=2,
                                  runtime=DEEPSEEK_V3_RUNTIME)
    published = DEEPSEEK_V3_GPU_HOURS_PER_TRILLION * 3600 / gpus * batch * seq / 1e12
    return shape, estimate, published


def test_deepseek_v3_on_its_published_layout_differs_by_what_the_time_model_leaves_out():
    """The estimate beside the published figure (docs/planning.md), term by term. The time model runs the matrix
    products in bf16 and exposes what 1F1B exposes; DeepSeek-V3 ran its GEMMs in FP8 (twice the tensor-core rate)
    and DualPipe, which overlaps the expert all-to-alls and the pipeline transfers with compute and all but removes
    the bubble. Taking those out of the estimate lands within the 25% the issue asks; the raw estimate is about 3x."""
    shape, estimate, published = deepseek_v3_published_step()
    assert shape.total_params() - shape.mtp_params() == 671_026_404_352  # transformers' count, checked above
    terms = estimate.as_dict()
    assert 2.5 < estimate.total / published < 4.0
    assert terms["expert_parallel"] > 0.2 * estimate.total and terms["bubble"] > 0.05 * estimate.total
    without_fp8_and_dualpipe = (terms["compute"] / 2 + terms["memory_bound"] + terms["data_parallel"]
                                + terms["optimizer"] + terms["overhead"])
    assert without_fp8_and_dualpipe == pytest.approx(published, rel=0.25)
