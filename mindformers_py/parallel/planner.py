"""``auto_parallel``: choose a layout from the model, the world, the device memory and the batch.

The planner enumerates every layout ``data_parallel x model_parallel x pipeline_stage = world size`` that
:meth:`ParallelConfig.validate_for` accepts (heads, KV heads, FFN and vocabulary divisible by the tensor-parallel
size, at least one layer per pipeline chunk, micro-batches dividing the per-rank batch), with the micro-batch
count, the ZeRO stage and the recompute mode as further choices. For each it estimates

* **memory per rank** (the busiest rank: the first or last pipeline stage): parameters, gradients and AdamW's two
  fp32 moments as each ZeRO stage shards them, and the activations saved for backward: the tensors our
  transformer layer actually keeps (counted op by op for :class:`~mindformers_py.layers.TransformerBlock`, in the
  spirit of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022: terms in
  sequence x batch x hidden, divided by the tensor-parallel size where the tensor is sharded), times the
  micro-batches a pipeline schedule keeps in flight, less what recompute drops;
* **time per step**: compute ``(6·N + 12·L·h·s)`` FLOPs per token (plus the re-run forward under recompute)
  spread over all devices, tensor-parallel all-reduces (4 per layer and micro-batch), the data-parallel gradient
  reduction (more traffic for ZeRO-1 on ``ZeroRedundancyOptimizer`` and ZeRO-3's re-gathers), pipeline
  point-to-point traffic and the bubble ``(p-1)/m`` of the ideal time (``(p-1)/(v·m)`` interleaved). Nothing is
  assumed to overlap, so estimates are conservative;

and picks the fastest layout per sample that fits the memory budget (ties: the one closest to what the config
asked for). The choice and its competitors are logged as a table (:meth:`AutoParallelPlan.table`).

``per_device_batch`` keeps HF's meaning (the batch of one data-parallel rank), so layouts with more data-parallel
ranks also process more samples per step; they are compared by time per sample. Give ``global_batch`` instead
to fix the samples per step (each layout's data-parallel size must then divide it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .config import ParallelConfig, RecomputeConfig
# The estimates live in their own modules; their public names are re-exported here, where callers import them.
from .cost_model import (
    ACTIVATION_SAVED_TENSORS,
    ADAM_STATE_BYTES,
    DEFAULT_ACTIVATION_SAVED,
    FP32_BYTES,
    MemoryEstimate,
    ModelShape,
    TimeEstimate,
    estimate_memory,
    estimate_step_time,
    layer_activation_bytes,
)
from .device_spec import GIB, GPU_EFFICIENCY, GPU_PEAK_FLOPS, DeviceSpec, host_available_memory, parse_bytes

__all__ = [
    "ACTIVATION_SAVED_TENSORS", "ADAM_STATE_BYTES", "DEFAULT_ACTIVATION_SAVED", "FP32_BYTES", "GIB", "GPU_EFFICIENCY",
    "GPU_PEAK_FLOPS", "RECOMPUTE_LEVELS", "AutoParallelPlan", "DeviceSpec", "LayoutEstimate", "MemoryEstimate",
    "ModelShape", "TimeEstimate", "auto_parallel", "default_world_size", "estimate_memory", "estimate_step_time",
    "host_available_memory", "layer_activation_bytes", "parse_bytes", "plan",
]

logger = logging.getLogger(__name__)

RECOMPUTE_LEVELS: tuple[Any, ...] = (False, "selective", "full")


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LayoutEstimate:
    """One candidate layout with its estimates."""

    config: ParallelConfig
    per_device_batch: int
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool
    changes: int
    """How many of the asked-for settings (ZeRO stage, recompute) the candidate raises to save memory."""

    @property
    def samples_per_second(self) -> float:
        """Throughput: the step's samples over the step's time."""
        return self.per_device_batch * self.config.dp / self.time.total

    @property
    def layout(self) -> tuple[int, int, int]:
        """(data_parallel, model_parallel, pipeline_stage)."""
        return self.config.dp, self.config.tp, self.config.pp

    def describe(self) -> str:
        """The layout in words: ``dp=2 tp=2 pp=2 (1f1b, 4 micro-batches) ZeRO-1 recompute=full``."""
        pc = self.config
        text = f"dp={pc.dp} tp={pc.tp} pp={pc.pp}"
        if pc.pp > 1:
            text += f" ({pc.pipeline_schedule}, {pc.micro_batches} micro-batches)"
        if pc.zero_stage:
            text += f" ZeRO-{pc.zero_stage}"
        if pc.recompute.enabled:
            text += f" recompute={pc.recompute.recompute}"
        return text


@dataclass
class AutoParallelPlan:
    """The planner's answer: the chosen layout as a config, and what it was compared with."""

    config: ParallelConfig
    """The chosen layout (``semi_auto_parallel``), validated for the world, model and batch."""
    chosen: LayoutEstimate
    candidates: list[LayoutEstimate]
    """The best variant of every valid (dp, tp, pp) layout (the fastest that fits, else the smallest)."""
    excluded: list[tuple[str, str]] = field(default_factory=list)
    """(layout, reason) for layouts refused before estimating (divisibility, batch, node size)."""
    world_size: int = 1
    device: DeviceSpec = field(default_factory=DeviceSpec)
    seq_length: int = 0

    def table(self) -> str:
        """A readable table of the candidates (memory per rank, time per step) with the choice marked."""
        header = (f"auto_parallel plan for {self.world_size} rank(s), {_fmt_bytes(self.device.usable_bytes)} usable "
                  f"per rank ({self.device.device_type}), sequence {self.seq_length}")
        cols = ["layout", "params", "grads", "optim", "activ", "total", "fits", "compute", "comm", "bubble",
                "step", "samples/s", ""]
        rows = []
        for est in sorted(self.candidates, key=_rank_key):
            mem, t = est.memory, est.time
            comm = t.tensor_parallel + t.data_parallel + t.pipeline_comm
            rows.append([est.describe(), _fmt_bytes(mem.parameters), _fmt_bytes(mem.gradients),
                         _fmt_bytes(mem.optimizer), _fmt_bytes(mem.activations), _fmt_bytes(mem.total),
                         "yes" if est.fits else "NO", _fmt_s(t.compute), _fmt_s(comm), _fmt_s(t.bubble),
                         _fmt_s(t.total), f"{est.samples_per_second:.3g}", "<- chosen" if est is self.chosen else ""])
        widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols))]
        lines = [header, "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        for layout, reason in self.excluded:
            lines.append(f"excluded {layout}: {reason}")
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: what was chosen and why."""
        fitting = sum(c.fits for c in self.candidates)
        est = self.chosen
        return (f"chose {est.describe()}: fastest estimated throughput ({est.samples_per_second:.3g} samples/s, "
                f"{_fmt_s(est.time.total)} per step) of {fitting} layout(s) that fit "
                f"{_fmt_bytes(self.device.usable_bytes)} per rank; estimated peak {_fmt_bytes(est.memory.total)}")


def _rank_key(est: LayoutEstimate) -> tuple[Any, ...]:
    """Fitting layouts first, fastest per sample first, then closest to what was asked, then smallest."""
    return (not est.fits, 1.0 / est.samples_per_second, est.changes, est.memory.total)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _escalations(current: int | str | bool, levels: Sequence[Any]) -> list[Any]:
    """``current`` and every level above it in ``levels``."""
    return list(levels[levels.index(current):]) if current in levels else [current]


def _micro_batch_choices(pp: int, batch: int) -> list[int]:
    if pp == 1:
        return [1]
    return [m for m in _divisors(batch) if m >= pp]


def plan(
    model_config: Any,
    world_size: int,
    per_device_batch: int | None = None,
    seq_length: int | None = None,
    *,
    global_batch: int | None = None,
    device: DeviceSpec | None = None,
    base: ParallelConfig | None = None,
    act_bytes: int = FP32_BYTES,
    require_fit: bool = True,
) -> AutoParallelPlan:
    """Choose a layout for ``world_size`` ranks (see the module docstring).

    Args:
        model_config: a GPT-style model config (``GPTConfig`` or any config with the same field names).
        world_size: ranks in the job.
        per_device_batch: sequences per data-parallel rank and step (HF's ``per_device_train_batch_size``).
        seq_length: tokens per sequence (default: the model's ``max_position_embeddings``).
        global_batch: sequences per step over all data-parallel ranks, instead of ``per_device_batch``.
        device: the device assumptions (default :meth:`DeviceSpec.detect`).
        base: the config whose other fields are kept (schedule, virtual stages, sequence/vocabulary parallelism)
            and whose ``optimizer_shard`` and ``recompute`` are the least the planner uses (it raises them only
            when memory requires).
        act_bytes: activation element size (2 for bf16 training).
        require_fit: refuse when no layout fits the memory budget (else return the smallest, marked as not
            fitting).

    Raises:
        ConfigError: no layout is valid for this world, model and batch, or none fits (with ``require_fit``).
    """
    if (per_device_batch is None) == (global_batch is None):
        raise ConfigError("give exactly one of per_device_batch or global_batch to the auto_parallel planner")
    base = base if base is not None else ParallelConfig(parallel_mode="auto_parallel")
    if base.parallel_mode != "auto_parallel":
        base = dataclasses.replace(base, parallel_mode="auto_parallel")
    device = device if device is not None else DeviceSpec.detect(world_size=world_size)
    seq_length = seq_length or getattr(model_config, "max_position_embeddings", None)
    if not seq_length:
        raise ConfigError("seq_length is required: the model config has no max_position_embeddings")
    shape = ModelShape.from_config(model_config)

    candidates: list[LayoutEstimate] = []
    excluded: list[tuple[str, str]] = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            name = f"dp={dp} tp={tp} pp={pp}"
            if tp > device.devices_per_node:
                excluded.append((name, f"model_parallel={tp} spans nodes (devices_per_node="
                                       f"{device.devices_per_node}); tensor parallelism stays within a node"))
                continue
            if global_batch is not None and global_batch % dp:
                excluded.append((name, f"global_batch={global_batch} is not divisible by data_parallel={dp}"))
                continue
            batch = per_device_batch if per_device_batch is not None else global_batch // dp
            variants, reason = _variants(base, world_size, model_config, shape, dp, tp, pp, batch, seq_length,
                                         device, act_bytes)
            if not variants:
                excluded.append((name, reason))
                continue
            candidates.append(min(variants, key=lambda e: _variant_key(e)))
    if not candidates:
        reasons = "; ".join(f"{layout}: {why}" for layout, why in excluded[:3])
        raise ConfigError(f"auto_parallel found no valid layout for world_size={world_size} ({reasons})")
    chosen = min(candidates, key=_rank_key)
    if not chosen.fits and require_fit:
        raise ConfigError(
            f"auto_parallel found no layout that fits memory_budget={_fmt_bytes(device.memory_bytes)} per rank "
            f"({_fmt_bytes(device.usable_bytes)} usable); the smallest estimate is {chosen.describe()} at "
            f"{_fmt_bytes(chosen.memory.total)}; give more memory or ranks, or a smaller batch or sequence"
        )
    return AutoParallelPlan(chosen.config, chosen, candidates, excluded, world_size, device, seq_length)


def _variant_key(est: LayoutEstimate) -> tuple[Any, ...]:
    # Within one (dp, tp, pp): the fastest that fits; if none fits, the smallest.
    if est.fits:
        return (0, est.time.total, est.changes, est.memory.total)
    return (1, est.memory.total, est.time.total, est.changes)


def _variants(base: ParallelConfig, world: int, model_config: Any, shape: ModelShape, dp: int, tp: int, pp: int,
              batch: int, seq: int, device: DeviceSpec, act_bytes: int) -> tuple[list[LayoutEstimate], str]:
    """Every (micro-batches, ZeRO stage, recompute) variant of one layout, estimated; or the reason none is valid."""
    zero_levels = _escalations(base.optimizer_shard, (0, 1, 2, 3)) if dp > 1 else [base.optimizer_shard]
    recompute_levels = _escalations(base.recompute.recompute, RECOMPUTE_LEVELS)
    out: list[LayoutEstimate] = []
    reason = ""
    micro_choices = _micro_batch_choices(pp, batch)
    if not micro_choices:
        return [], f"per-rank batch {batch} cannot be split into >= {pp} micro-batches"
    for micro in micro_choices:
        for zero in zero_levels:
            for level in recompute_levels:
                recompute = base.recompute if level == base.recompute.recompute else \
                    RecomputeConfig(recompute=level)
                fields: dict[str, Any] = {"micro_batch_num": micro, "optimizer_shard": zero, "recompute": recompute}
                if pp == 1:
                    fields["virtual_pipeline_stages"] = 1
                    fields["pipeline_schedule"] = "1f1b" if base.pipeline_schedule == "interleaved_1f1b" \
                        else base.pipeline_schedule
                try:
                    config = base.with_layout(dp, tp, pp, **fields)
                    config.validate()
                    config.validate_for(world, model_config, per_device_batch=batch)
                except ConfigError as err:
                    reason = str(err)
                    continue
                memory = estimate_memory(shape, config, batch, seq, act_bytes)
                time = estimate_step_time(shape, config, batch, seq, device, act_bytes)
                changes = int(zero != base.optimizer_shard) + int(level != base.recompute.recompute)
                out.append(LayoutEstimate(config, batch, memory, time, memory.total <= device.usable_bytes, changes))
    return out, reason


def auto_parallel(
    parallel_config: ParallelConfig,
    model_config: Any,
    world_size: int,
    per_device_batch: int,
    seq_length: int | None = None,
    *,
    device: DeviceSpec | None = None,
    memory_budget: int | str | None = None,
    act_bytes: int = FP32_BYTES,
    log: logging.Logger | None = None,
) -> ParallelConfig:
    """The layout to run an ``auto_parallel`` config with: :func:`plan`, logged as a table; other modes are
    returned unchanged.

    ``memory_budget`` (bytes or ``"6GiB"``) overrides the detected memory per rank; ``device`` overrides all
    device assumptions. When a process group is already running, rank 0 plans (free memory differs a little
    between devices, and every rank must run the same layout) and the others receive its answer.
    """
    if parallel_config.parallel_mode != "auto_parallel":
        return parallel_config
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    answer: list[Any] = [None]
    if not shared or dist.get_rank() == 0:
        if device is None:
            device = DeviceSpec.detect(memory_budget=memory_budget, world_size=world_size)
        elif memory_budget is not None:
            device = dataclasses.replace(device, memory_bytes=parse_bytes(memory_budget))
        try:
            result = plan(model_config, world_size, per_device_batch, seq_length, device=device, base=parallel_config,
                          act_bytes=act_bytes)
            (log or logger).info("%s", result.table())
            answer = [result.config.to_dict()]
        except ConfigError as err:
            answer = [err]
    if shared:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], ConfigError):
        raise answer[0]
    return ParallelConfig.from_dict(answer[0])


def default_world_size(parallel_config: ParallelConfig, device_type: str | None = None) -> int:
    """Ranks an ``auto_parallel`` run uses when nothing fixes them: torchrun's ``WORLD_SIZE``, else every visible
    GPU, else the product of the config's size hints."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return parallel_config.required_world_size()
