"""The time model's mechanisms one by one (rooflines, links, overlap, schedules) and the device catalog."""

from __future__ import annotations

import pytest

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig
from mindformers_py.planner.device_spec import catalog_name_for, device_catalog, load_device
from mindformers_py.planner.step_time import (
    Runtime,
    all_to_all_seconds,
    estimate_step_time,
    gemm_seconds,
    ring_seconds,
)

A100 = load_device("a100_80gb")
LLAMA_7B = mf.GPTConfig(flavour="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                        num_attention_heads=32, intermediate_size=11008, max_position_embeddings=4096)


def layout(**fields):
    return ParallelConfig(parallel_mode="semi_auto_parallel", **fields)


def test_catalog_entries_load_with_their_datasheet_figures():
    assert {"a100_40gb", "a100_80gb", "h100_80gb", "h200"} <= set(device_catalog())
    for name, entry in device_catalog().items():
        spec = load_device(name)
        assert spec.name == name and spec.device_type == "cuda"
        assert spec.flops == pytest.approx(entry["peak_flops"] * entry["gemm_efficiency"])
        assert spec.memory_bytes > 0 and spec.hbm_bandwidth > 0 and spec.inter_node_bandwidth > 0
    assert load_device("h100_80gb", flops=5e14).flops == 5e14  # an explicit rate wins over peak x efficiency
    assert load_device("a100_80gb", peak_flops="624e12").flops == pytest.approx(2 * A100.flops)
    assert catalog_name_for("NVIDIA A100-SXM4-80GB") == "a100_80gb"
    assert catalog_name_for("NVIDIA A100-SXM4-40GB") == "a100_40gb"
    assert catalog_name_for("NVIDIA H100 80GB HBM3") == "h100_80gb" and catalog_name_for("NVIDIA H200") == "h200"
    assert catalog_name_for("Tesla T4") is None


def test_thin_matrix_products_are_memory_bound():
    big = gemm_seconds(8192, 8192, 8192, A100, 2)
    assert big == pytest.approx(2 * 8192**3 / A100.flops)  # compute-bound: the sustained rate
    thin = gemm_seconds(8192, 8192, 64, A100, 2)  # attention-like: a head-size inner dimension
    assert thin / (2 * 8192**2 * 64) > 1.5 * big / (2 * 8192**3)  # slower per FLOP


def test_collectives_across_nodes_use_the_network():
    size = 1 << 30
    inside = ring_seconds(size, 8, 1, A100)
    across = ring_seconds(size, 16, 1, A100)
    assert across > inside
    # Data-parallel rings with 8 ranks per node use all 8 NICs; with one rank per node, one.
    assert ring_seconds(size, 16, 8, A100) > 4 * ring_seconds(size, 16, 1, A100)
    assert all_to_all_seconds(size, 8, 1, A100) < all_to_all_seconds(size, 16, 1, A100)
    assert ring_seconds(size, 1, 1, A100) == 0 == all_to_all_seconds(size, 1, 1, A100)


def test_gradient_reduction_hides_behind_backward_only_when_overlapped():
    config = layout(data_parallel=64)
    overlapped = estimate_step_time(LLAMA_7B, config, 2, 2048, A100, act_bytes=2)
    after = estimate_step_time(LLAMA_7B, config, 2, 2048, A100, act_bytes=2,
                               runtime=Runtime(overlap_grad_reduce=False))
    assert 0 < overlapped.data_parallel < after.data_parallel
    assert overlapped.compute == after.compute


def test_schedules_bubbles_and_pipeline_transfers():
    def time(**fields):
        return estimate_step_time(LLAMA_7B, layout(data_parallel=2, pipeline_stage=8, **fields), 32, 2048, A100,
                                  act_bytes=2)

    one_f_one_b, gpipe = time(micro_batch_num=16), time(micro_batch_num=16, pipeline_schedule="gpipe")
    assert one_f_one_b.bubble == gpipe.bubble > 0  # same fill and drain; 1F1B only keeps fewer in flight
    interleaved = time(micro_batch_num=16, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2)
    assert interleaved.bubble < one_f_one_b.bubble and interleaved.pipeline_comm > one_f_one_b.pipeline_comm
    assert time(micro_batch_num=32).bubble < one_f_one_b.bubble
    overlapped = estimate_step_time(LLAMA_7B, layout(data_parallel=2, pipeline_stage=8, micro_batch_num=16), 32,
                                    2048, A100, act_bytes=2, runtime=Runtime(overlap_p2p=True))
    assert overlapped.pipeline_comm < one_f_one_b.pipeline_comm


def test_sequence_parallelism_splits_the_memory_bound_work():
    plain = estimate_step_time(LLAMA_7B, layout(model_parallel=8), 8, 2048, A100, act_bytes=2)
    sp = estimate_step_time(LLAMA_7B, layout(model_parallel=8, use_seq_parallel=True), 8, 2048, A100, act_bytes=2)
    assert sp.memory_bound < plain.memory_bound and sp.tensor_parallel == plain.tensor_parallel


def test_fused_kernels_move_less_memory_than_eager_ops():
    eager = estimate_step_time(LLAMA_7B, layout(), 8, 2048, A100, act_bytes=2)
    fused = estimate_step_time(LLAMA_7B, layout(), 8, 2048, A100, act_bytes=2, runtime=Runtime(kernels="fused"))
    assert fused.memory_bound < eager.memory_bound / 2 and fused.compute == eager.compute


def test_runtime_values_are_checked():
    with pytest.raises(ConfigError, match="attention='paged' is not valid; choose one of: 'flash', 'materialized'"):
        Runtime(attention="paged")
    with pytest.raises(ConfigError, match="kernels='jit' is not valid"):
        Runtime(kernels="jit")
