"""FSDP2 on CPU gathers and reduces with gloo's in-place list collectives (``parallel/gloo_collectives.py``): the
same values as the tensor forms FSDP2 calls by default, installed on every unit a CPU layout shards. (Their memory,
no whole-size temporary, is measured by ``benchmarks/bench_loading.py``; the layouts' gradients against stand-alone
are ``test_parallel_layouts.py``'s.)"""

from __future__ import annotations

import torch

from support.dist_utils import run_workers


def _compare(rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    from mindformers_py.parallel.gloo_collectives import InPlaceAllGather, InPlaceReduceScatter

    group = dist.group.WORLD
    out: dict[str, bool] = {}
    for dtype in (torch.float32, torch.bfloat16):
        shard = 7  # odd, as FSDP2's padded shards may be
        gen = torch.Generator().manual_seed(rank)
        expected = torch.empty(shard * world, dtype=dtype)
        mine = torch.randn(shard, generator=gen).to(dtype)
        dist.all_gather_into_tensor(expected, mine)
        comm = InPlaceAllGather()
        output = comm.allocate((shard * world,), dtype=dtype, device=torch.device("cpu"))
        own = output.narrow(0, shard * rank, shard)  # FSDP2 hands its input as this rank's slot of the output
        own.copy_(mine)
        comm(output, own, group, async_op=True).wait()
        out[f"all_gather {dtype}"] = torch.equal(output, expected)

        full = torch.randn(shard * world, generator=gen).to(dtype)
        expected = torch.empty(shard, dtype=dtype)
        dist.reduce_scatter_tensor(expected, full.clone())
        output = torch.empty(shard, dtype=dtype)
        InPlaceReduceScatter()(output, full, group, op=dist.ReduceOp.SUM)
        out[f"reduce_scatter {dtype}"] = torch.equal(output, expected)
    return out


def _installed(rank: int, world: int) -> list[str]:
    from mindformers_py.parallel import ParallelConfig
    from mindformers_py.parallel.data import apply_data_parallel
    from mindformers_py.parallel.mesh import build_mesh
    import mindformers_py as mf

    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=world, optimizer_shard=3).resolve(world)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=16))
    apply_data_parallel(model, build_mesh(config, device_type="cpu"), config)
    return sorted({type(group._all_gather_comm).__name__ + "/" + type(group._reduce_scatter_comm).__name__
                   for module in model.modules() if hasattr(module, "_get_fsdp_state")
                   for group in module._get_fsdp_state()._fsdp_param_groups})


def test_in_place_collectives_give_the_tensor_forms_values():
    for rank_result in run_workers(_compare, 2):
        assert rank_result and all(rank_result.values()), rank_result


def test_every_unit_of_a_cpu_zero3_layout_uses_them():
    assert run_workers(_installed, 2) == [["InPlaceAllGather/InPlaceReduceScatter"]] * 2
