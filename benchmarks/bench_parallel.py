"""Memory per rank of the parallel layouts, counted exactly (not sampled from an allocator).

For one AdamW training step of the same GPT (Llama flavour by default) under each layout, every rank reports:

* ``params``: bytes of the parameters it holds between steps (its shards for FSDP / tensor parallelism);
* ``params in bwd``: bytes of the parameters it holds when backward starts (ZeRO-2 keeps the gathered
  parameters from forward to backward, ZeRO-3 re-gathers them layer by layer);
* ``grads``: bytes of the gradients after backward (sharded under ZeRO-2/3);
* ``optim``: bytes of the optimizer state after the step (AdamW's two moments and step counters);
* ``activations``: the peak bytes of the tensors autograd keeps saved for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, from when it is saved until backward releases
  it; parameters excluded). Under recompute only what the checkpointed regions keep is counted, which is exactly
  what stays alive until backward; under pipeline schedules, the micro-batches a schedule keeps in flight.

Every rank's data-parallel batch is ``--batch`` sequences (HF's per-device meaning), so activations of data-parallel
layouts equal stand-alone's, while tensor parallelism splits them. A ``ratio`` column divides the rank's total by
stand-alone's. Layouts of two processes run in one job started with :func:`mindformers_py.launcher.launch.launch`.
The last columns put the ``auto_parallel`` planner's estimate for the layout's busiest rank
(:func:`mindformers_py.planner.search.estimate_memory`, without full recompute's transient re-materialised layer)
next to the busiest rank's measured peak (params in bwd + grads + optim + activations).

    python benchmarks/bench_parallel.py              # defaults: 4 layers, hidden 256, seq 256, batch 4
    python benchmarks/bench_parallel.py --layers 2 --hidden 128 --seq 128
    python benchmarks/bench_parallel.py --moe        # a GPT-MoE of the same shape (8 experts of half the MLP,
                                                     # top-2, dropless) under expert-parallel layouts (MOE_LAYOUTS)

Adding a layout: append a row to ``LAYOUTS``. Layouts whose model is not one module on each rank (pipeline
parallelism) plug in through ``BUILDERS``: a function of (model, config, mesh) that returns a :class:`Training`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import mindformers_py as mf
from mindformers_py.parallel import Layout, ParallelConfig, ParallelMesh, build_mesh, parallelize
from mindformers_py.parallel.data import shard_optimizer
from mindformers_py.parallel.pipelining.schedule import build_pipeline
from mindformers_py.planner.search import estimate_memory

MIB = 2**20

# name -> (processes, ParallelConfig fields)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "stand_alone": (1, {}),
    "recompute full": (1, {"recompute": "full"}),
    "recompute selective": (1, {"recompute": "selective"}),
    "dp2": (2, {"parallel_mode": "data_parallel", "data_parallel": 2}),
    "ZeRO-1 dp2": (2, {"parallel_mode": "data_parallel", "data_parallel": 2, "optimizer_shard": 1}),
    "ZeRO-2 dp2": (2, {"parallel_mode": "data_parallel", "data_parallel": 2, "optimizer_shard": 2}),
    "ZeRO-3 dp2": (2, {"parallel_mode": "data_parallel", "data_parallel": 2, "optimizer_shard": 3}),
    "tp2": (2, {"parallel_mode": "semi_auto_parallel", "model_parallel": 2}),
    "tp2 + seq parallel": (2, {"parallel_mode": "semi_auto_parallel", "model_parallel": 2, "use_seq_parallel": True}),
    "tp2 + vocab parallel": (2, {"parallel_mode": "semi_auto_parallel", "model_parallel": 2, "vocab_emb_dp": False}),
    "pp2 1f1b": (2, {"parallel_mode": "semi_auto_parallel", "pipeline_stage": 2, "micro_batch_num": 4}),
    "pp2 gpipe": (2, {"parallel_mode": "semi_auto_parallel", "pipeline_stage": 2, "micro_batch_num": 4,
                      "pipeline_schedule": "gpipe"}),
    "pp2 interleaved": (2, {"parallel_mode": "semi_auto_parallel", "pipeline_stage": 2, "micro_batch_num": 4,
                            "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2}),
}


# The same, for the GPT-MoE model (--moe): expert parallelism borrowed from data parallelism, alone and with
# ZeRO, tensor parallelism and pipeline stages.
MOE_LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "stand_alone": (1, {}),
    "dp2": (2, {"parallel_mode": "semi_auto_parallel", "data_parallel": 2}),
    "dp2 ep2": (2, {"parallel_mode": "semi_auto_parallel", "data_parallel": 2, "expert_parallel": 2}),
    "ZeRO-3 dp2 ep2": (2, {"parallel_mode": "semi_auto_parallel", "data_parallel": 2, "expert_parallel": 2,
                           "optimizer_shard": 3}),
    "tp2": (2, {"parallel_mode": "semi_auto_parallel", "model_parallel": 2}),
    "pp2 1f1b": (2, {"parallel_mode": "semi_auto_parallel", "pipeline_stage": 2, "micro_batch_num": 4}),
    "dp4 ep4": (4, {"parallel_mode": "semi_auto_parallel", "data_parallel": 4, "expert_parallel": 4}),
    "dp2 tp2 ep2": (4, {"parallel_mode": "semi_auto_parallel", "data_parallel": 2, "model_parallel": 2,
                        "expert_parallel": 2}),
}


def layouts_of(args: argparse.Namespace) -> dict[str, tuple[int, dict[str, Any]]]:
    """The layouts this run measures."""
    return MOE_LAYOUTS if args.moe else LAYOUTS


@dataclass
class Training:
    """What one layout trains: the module(s) this rank runs, its optimizer and one step over a batch."""

    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    forward: Callable[[torch.Tensor], torch.Tensor]
    """Batch of token ids -> this rank's loss (forward only)."""
    backward: Callable[[torch.Tensor], None] = field(default=lambda loss: loss.backward())
    warmup: Callable[[torch.Tensor], None] | None = None
    """Run once before the measured step (not counted): one-time work such as pipeline shape inference."""


def build_plain(model: nn.Module, config: Layout, mesh: ParallelMesh) -> Training:
    """A model that is one module on every rank: ``parallelize`` it, AdamW (ZeRO-1 wrapped when asked)."""
    parallelize(model, config, mesh)
    optimizer = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False), mesh, config)
    context = loss_parallel if config.vocab_parallel else contextlib.nullcontext

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with context():
            return model(ids, labels=ids).loss

    def backward(loss: torch.Tensor) -> None:
        with context():
            loss.backward()

    return Training([model], optimizer, forward, backward)


def build_pipelined(model: nn.Module, config: Layout, mesh: ParallelMesh) -> Training:
    """This rank's pipeline stages, each parallelized like a model; one schedule step runs forward and backward of
    every micro-batch, so ``forward`` does both (and the counter sees the schedule's in-flight peak)."""
    pipe = build_pipeline(model, config, mesh,
                          parallelize=lambda part: parallelize(part, config, mesh, stage=part.pp_rank))
    optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=1e-4, foreach=False)

    def step(ids: torch.Tensor) -> torch.Tensor:
        return pipe.step({"input_ids": ids, "labels": ids})

    def warmup(ids: torch.Tensor) -> None:
        # torch infers the stages' activation shapes with an extra forward on the first step; measure a later one.
        step(ids)
        optimizer.zero_grad(set_to_none=True)

    return Training(pipe.model_parts, optimizer, step, backward=lambda loss: None, warmup=warmup)


# (predicate on the config, builder): the first whose predicate holds builds the layout.
BUILDERS: list[tuple[Callable[[Layout], bool], Callable[..., Training]]] = [
    (lambda config: config.pp == 1, build_plain),
    (lambda config: config.pp > 1, build_pipelined),
]


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory behind ``tensor``: its storage, or for a wrapper subclass without one (a
    collective's result not yet waited for) the wrapped tensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    tensor = getattr(tensor, "elem", tensor)  # AsyncCollectiveTensor wraps the collective's output
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Saved:
    """What autograd keeps for one saved tensor: dies when backward releases it, which ends its count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """The peak bytes autograd keeps saved for backward (each storage once, while any tensor saved from it is
    held), leaving out parameter storages."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.holders: dict[int, int] = {}  # storage -> saved tensors holding it
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        params = {_storage(p)[0] for m in self.modules for p in m.parameters()}
        ptr, nbytes = _storage(tensor)
        if ptr in params or not nbytes:
            return tensor
        if not self.holders.get(ptr):
            self.sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[ptr] = self.holders.get(ptr, 0) + 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, ptr)
        return saved

    def _release(self, ptr: int) -> None:
        self.holders[ptr] -= 1
        if not self.holders[ptr]:
            self.live -= self.sizes[ptr]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda saved: saved.tensor if isinstance(saved, _Saved) else saved)

    @property
    def bytes(self) -> int:
        return self.peak


def model_config(args: argparse.Namespace) -> mf.GPTConfig:
    """The Llama-flavour GPT, or with ``--moe`` its GPT-MoE twin: every MLP 8 experts of half its width, top-2,
    dropless (the padded dispatch buffer holds the largest expert load for every expert)."""
    moe = {}
    if args.moe:
        dense = mf.GPTConfig(flavour="llama", hidden_size=args.hidden, num_attention_heads=args.heads).intermediate_size
        moe = dict(output_router_logits=True, moe_config={"expert_num": 8, "num_experts_chosen": 2,
                                                          "routing_policy": "dropless", "moe_intermediate_size": dense // 2})
    return mf.GPTConfig(flavour="llama", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                        max_position_embeddings=args.seq, **moe)


def measure(name: str, fields: dict[str, Any], args: argparse.Namespace) -> dict[str, int]:
    """One training step of layout ``name`` on this rank; returns the byte counts of the module docstring."""
    config = ParallelConfig(**fields).resolve(int(os.environ.get("WORLD_SIZE", "1")))
    mesh = build_mesh(config)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(model_config(args)).train()
    builder = next(build for applies, build in BUILDERS if applies(config))
    training = builder(model, config, mesh)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(mesh.dp_rank))
    if training.warmup is not None:
        training.warmup(ids)
    counter = SavedActivations(training.modules)
    with counter.hooks():
        loss = training.forward(ids)
    params_in_backward = sum(_local_bytes(p) for m in training.modules for p in m.parameters())
    training.backward(loss)
    grads = sum(_local_bytes(p.grad) for m in training.modules for p in m.parameters())
    training.optimizer.step()
    local_optimizer = getattr(training.optimizer, "optim", training.optimizer)  # ZeRO-1: this rank's share
    optim = sum(_local_bytes(v) for state in local_optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor))
    params = sum(_local_bytes(p) for m in training.modules for p in m.parameters())
    return {"params": params, "params in bwd": params_in_backward, "grads": grads, "optim": optim,
            "activations": counter.bytes}


def _job(layouts: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Every layout of one process count, one after the other, in this worker (or this process)."""
    torch.set_num_threads(1)
    return {name: measure(name, fields, args) for name, fields in layouts.items()}


def run_all(args: argparse.Namespace) -> dict[str, list[dict[str, int]]]:
    """Per-rank byte counts of every layout: {name: [rank 0, rank 1, ...]}."""
    from mindformers_py.launcher.launch import launch

    results: dict[str, list[dict[str, int]]] = {}
    by_world: dict[int, dict[str, dict[str, Any]]] = {}
    layouts_all = layouts_of(args)
    for name, (world, fields) in layouts_all.items():
        by_world.setdefault(world, {})[name] = fields
    for world, layouts in sorted(by_world.items()):
        if world == 1:
            per_rank = {0: _job(layouts, args)}
        else:
            per_rank = launch(_job, world, layouts, args)
        for name in layouts:
            results[name] = [per_rank[rank][name] for rank in sorted(per_rank)]
    return {name: results[name] for name in layouts_all}


COLUMNS = ("params", "params in bwd", "grads", "optim", "activations")


def planner_estimate(name: str, args: argparse.Namespace) -> int:
    """The planner's peak bytes for layout ``name``'s busiest rank, less full recompute's transient layer (which
    the saved-tensor count does not see)."""
    estimate = estimate_memory(model_config(args), ParallelConfig(**layouts_of(args)[name][1]), args.batch, args.seq)
    return estimate.total - estimate.recompute


def table(results: dict[str, list[dict[str, int]]], args: argparse.Namespace) -> str:
    """Rank 0's numbers in MiB, with its total (params + grads + optim + activations) against stand-alone's, and
    the planner's estimate against the busiest rank's measured peak."""
    def total(row: dict[str, int]) -> int:
        return row["params"] + row["grads"] + row["optim"] + row["activations"]

    def peak(row: dict[str, int]) -> int:
        return row["params in bwd"] + row["grads"] + row["optim"] + row["activations"]

    base = total(results["stand_alone"][0])
    head = (f"{'layout (rank 0)':<22}" + "".join(f"{c:>15}" for c in COLUMNS) + f"{'total':>11}{'ratio':>8}"
            f"{'peak (max)':>12}{'planner est':>13}{'est/meas':>10}")
    lines = [head, "-" * len(head)]
    for name, ranks in results.items():
        row = ranks[0]
        cells = "".join(f"{row[c] / MIB:>15.2f}" for c in COLUMNS)
        measured = max(peak(r) for r in ranks)
        estimated = planner_estimate(name, args)
        lines.append(f"{name:<22}{cells}{total(row) / MIB:>11.2f}{total(row) / base:>8.2f}"
                     f"{measured / MIB:>12.2f}{estimated / MIB:>13.2f}{estimated / measured:>10.2f}")
    lines.append("(MiB per rank; params/grads/optim exact, activations = peak of the tensors saved for backward in one "
                 "step; peak (max) = the busiest rank's params in bwd + grads + optim + activations)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--moe", action="store_true", help="a GPT-MoE model under the expert-parallel MOE_LAYOUTS")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_all(args)
    print(table(results, args))
    if args.moe:
        stand, ep4 = results["stand_alone"][0], results["dp4 ep4"][0]
        print(f"dp4 ep4 state (params+grads+optim) / stand-alone: "
              f"{sum(ep4[k] for k in ('params', 'grads', 'optim')) / sum(stand[k] for k in ('params', 'grads', 'optim')):.3f}")
        return
    stand, zero3 = results["stand_alone"][0], results["ZeRO-3 dp2"][0]
    state = ("params", "grads", "optim")
    print(f"ZeRO-3 dp2 state (params+grads+optim) / stand-alone: "
          f"{sum(zero3[k] for k in state) / sum(stand[k] for k in state):.3f} (ideal 1/2)")
    print(f"full recompute saved activations / stand-alone: "
          f"{results['recompute full'][0]['activations'] / stand['activations']:.3f}; selective: "
          f"{results['recompute selective'][0]['activations'] / stand['activations']:.3f}")


if __name__ == "__main__":
    main()
