"""Choose a layout from the model, the world, the device and the batch: the in-run ``auto_parallel`` mode and the
``mindformers-py plan`` command share this search.

The planner enumerates every layout ``data_parallel x context_parallel x model_parallel x pipeline_stage = world
size`` (with ``expert_parallel`` ranks borrowed from data and context parallelism for MoE models) that
:meth:`ParallelConfig.validate_for`
accepts (heads, KV heads, FFN and vocabulary divisible by the tensor-parallel size, at least one layer per
pipeline chunk, micro-batches dividing the per-rank batch, experts divisible by the expert-parallel size, the
sequence and heads divisible as context parallelism needs), with
the micro-batch count, the ZeRO stage and the recompute mode as further choices; with ``full_search`` also the
pipeline schedule and its virtual stages, and sequence and vocabulary parallelism. For each it estimates

* **memory per rank** (the busiest rank: the first or last pipeline stage): parameters, gradients and AdamW's two
  fp32 moments as each ZeRO stage shards them (expert parameters over the ranks holding the same experts), and the
  activations saved for backward: the tensors our transformer layer actually keeps (counted op by op for
  :class:`~mindformers_py.layers.TransformerBlock`, in the spirit of Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022: terms in sequence x batch x hidden, divided by the
  tensor-parallel size where the tensor is sharded), times the micro-batches a pipeline schedule keeps in flight,
  less what recompute drops (:mod:`.cost_model`);
* **time per step** (:mod:`.step_time`): matrix products on a roofline (so small shards and thin products are
  slower per FLOP), memory-bound kernels, tensor-parallel collectives, expert-parallel all-to-alls, the
  data-parallel gradient reduction where it is not hidden behind the backward pass, pipeline transfers and the
  bubble of the schedule (``(p-1)`` micro-batch times, ``(p-1)/v`` interleaved);

and picks the fastest layout per sample that fits the memory budget (ties: the one closest to what the config
asked for). Context parallelism (:mod:`.context_cost`) splits each sequence instead of the batch: it is searched when
the config asks for it (``context_parallel > 1``), when the sequence is long for the model (attention's FLOPs per
token reach the matrix products') or when no layout without it fits; otherwise splitting the batch does the same
work per rank without key/value traffic. The choice and its competitors are logged as a table
(:meth:`AutoParallelPlan.table`).

``per_device_batch`` keeps HF's meaning (the batch of one data-parallel rank), so layouts with more data-parallel
ranks also process more samples per step; they are compared by time per sample. Give ``global_batch`` instead
to fix the samples per step (each layout's data-parallel size must then divide it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..parallel.config import ParallelConfig, RecomputeConfig
# The estimates live in their own modules; their public names are re-exported here, where callers import them.
from .cost_model import (
    ACTIVATION_SAVED_TENSORS,
    ADAM_STATE_BYTES,
    DEFAULT_ACTIVATION_SAVED,
    FP32_BYTES,
    MemoryEstimate,
    ModelShape,
    TimeEstimate,
    as_shape,
    estimate_memory,
    estimate_step_time,
    layer_activation_bytes,
)
from .device_spec import GIB, GPU_EFFICIENCY, GPU_PEAK_FLOPS, DeviceSpec, host_available_memory, parse_bytes
from .step_time import Runtime

__all__ = [
    "ACTIVATION_SAVED_TENSORS", "ADAM_STATE_BYTES", "DEFAULT_ACTIVATION_SAVED", "FP32_BYTES", "GIB", "GPU_EFFICIENCY",
    "GPU_PEAK_FLOPS", "RECOMPUTE_LEVELS", "AutoParallelPlan", "DeviceSpec", "LayoutEstimate", "MemoryEstimate",
    "ModelShape", "Runtime", "TimeEstimate", "auto_parallel", "default_world_size", "estimate_memory",
    "estimate_step_time", "host_available_memory", "layer_activation_bytes", "parse_bytes", "plan",
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
    seq_length: int = 0
    """Tokens per sequence."""
    model_flops_per_token: float = 0.0
    """Training FLOPs per token without recompute (:meth:`ModelShape.flops_per_token`), for MFU."""

    @property
    def samples_per_second(self) -> float:
        """Throughput: the step's samples over the step's time."""
        return self.per_device_batch * self.config.dp / self.time.total

    @property
    def tokens_per_second(self) -> float:
        """Throughput in tokens (samples x sequence length) over all ranks."""
        return self.samples_per_second * self.seq_length

    def mfu(self, device: DeviceSpec) -> float | None:
        """Model FLOPs utilisation: model FLOPs per second over the peak of every rank (None without a peak)."""
        if not device.peak_flops or not self.model_flops_per_token:
            return None
        world = self.config.required_world_size()
        return self.tokens_per_second * self.model_flops_per_token / (device.peak_flops * world)

    @property
    def layout(self) -> tuple[int, int, int]:
        """(data_parallel, model_parallel, pipeline_stage)."""
        return self.config.dp, self.config.tp, self.config.pp

    def describe(self) -> str:
        """The layout in words: ``dp=2 cp=2(ring) tp=2 pp=2 (1f1b, 4 micro-batches) ZeRO-1 recompute=full``."""
        pc = self.config
        text = f"dp={pc.dp}"
        if pc.cp > 1:
            text += f" cp={pc.cp}({pc.context_parallel_algo})"
        text += f" tp={pc.tp} pp={pc.pp}"
        if pc.ep > 1:
            text += f" ep={pc.ep}"
        if pc.pp > 1:
            schedule = pc.pipeline_schedule + (f" v={pc.vpp}" if pc.vpp > 1 else "")
            text += f" ({schedule}, {pc.micro_batches} micro-batches)"
        if pc.zero_stage:
            text += f" ZeRO-{pc.zero_stage}"
        if pc.recompute.enabled:
            text += f" recompute={pc.recompute.recompute}"
            if pc.recompute.recompute == "selective" and pc.recompute.select_recompute != ("attention_core",):
                text += "(" + "+".join(pc.recompute.select_recompute) + ")"
        if pc.sequence_parallel:
            text += " sp"
        return text


@dataclass
class AutoParallelPlan:
    """The planner's answer: the chosen layout as a config, and what it was compared with."""

    config: ParallelConfig
    """The chosen layout (``semi_auto_parallel``), validated for the world, model and batch."""
    chosen: LayoutEstimate
    candidates: list[LayoutEstimate]
    """The best variant of every valid (dp, tp, pp, ep) layout (the fastest that fits, else the smallest)."""
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
            rows.append([est.describe(), _fmt_bytes(mem.parameters), _fmt_bytes(mem.gradients),
                         _fmt_bytes(mem.optimizer), _fmt_bytes(mem.activations), _fmt_bytes(mem.total),
                         "yes" if est.fits else "NO", _fmt_s(t.compute + t.memory_bound), _fmt_s(t.communication),
                         _fmt_s(t.bubble), _fmt_s(t.total), f"{est.samples_per_second:.3g}",
                         "<- chosen" if est is self.chosen else ""])
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


def _schedules(base: ParallelConfig, shape: ModelShape, pp: int, full_search: bool) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try for ``pp`` stages: the base config's, or with ``full_search`` 1F1B and
    interleaved 1F1B over every virtual-stage count that splits the layers evenly (GPipe's bubble is 1F1B's and it
    keeps more micro-batches in flight, so it is tried only when asked for)."""
    if pp == 1:
        return [("gpipe" if base.pipeline_schedule == "gpipe" else "1f1b", 1)]
    if not full_search:
        return [(base.pipeline_schedule, base.virtual_pipeline_stages)]
    choices = [("gpipe", 1)] if base.pipeline_schedule == "gpipe" else [("1f1b", 1)]
    layers = shape.total_layers
    choices += [("interleaved_1f1b", v) for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
    return choices


def _expert_parallel_choices(base: ParallelConfig, shape: ModelShape, dp: int, full_search: bool) -> list[int]:
    """Expert-parallel sizes for ``dp`` data-parallel ranks: divisors of both ``dp`` and the expert count (all of
    them with ``full_search``, else the base config's when it is one)."""
    if not shape.is_moe:
        return [1]
    valid = [e for e in _divisors(dp) if shape.experts % e == 0]
    if full_search:
        return valid
    return [base.expert_parallel] if base.expert_parallel in valid else []


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
    runtime: Runtime | None = None,
    full_search: bool = False,
    trainable_params: int | None = None,
    fused_loss: bool = False,
) -> AutoParallelPlan:
    """Choose a layout for ``world_size`` ranks (see the module docstring).

    Args:
        model_config: a GPT-style model config (``GPTConfig`` or any config with the same field names), an HF
            ``config.json`` dict or a :class:`ModelShape`.
        world_size: ranks in the job.
        per_device_batch: sequences per data-parallel rank and step (HF's ``per_device_train_batch_size``).
        seq_length: tokens per sequence (default: the model's ``max_position_embeddings``).
        global_batch: sequences per step over all data-parallel ranks, instead of ``per_device_batch``.
        device: the device assumptions (default :meth:`DeviceSpec.detect`).
        base: the config whose other fields are kept (schedule, virtual stages, sequence/vocabulary and expert
            parallelism unless ``full_search``) and whose ``optimizer_shard`` and ``recompute`` are the least the
            planner uses (it raises them only when memory requires).
        act_bytes: activation element size (2 for bf16 training).
        require_fit: refuse when no layout fits the memory budget (else return the smallest, marked as not
            fitting).
        runtime: the training software's behaviour for the time model (default: ours).
        full_search: also choose the pipeline schedule and virtual stages, expert parallelism, and turn on
            sequence and vocabulary parallelism with tensor parallelism (the ``plan`` command's search).
        trainable_params: a peft adapter's trainable parameters: gradients and optimizer state are counted for
            those alone (the frozen base model is held as usual).
        fused_loss: the run's ``TrainingArguments.fused_loss`` (no whole logits where the head can be fused).

    Raises:
        ConfigError: no layout is valid for this world, model and batch, or none fits (with ``require_fit``).
    """
    if (per_device_batch is None) == (global_batch is None):
        raise ConfigError("give exactly one of per_device_batch or global_batch to the auto_parallel planner")
    base = base if base is not None else ParallelConfig(parallel_mode="auto_parallel")
    if base.parallel_mode != "auto_parallel":
        base = dataclasses.replace(base, parallel_mode="auto_parallel")
    device = device if device is not None else DeviceSpec.detect(world_size=world_size)
    shape = as_shape(model_config)
    seq_length = seq_length or getattr(model_config, "max_position_embeddings", None) or shape.max_positions
    if not seq_length:
        raise ConfigError("seq_length is required: the model config has no max_position_embeddings")
    search = _Search(base, shape, model_config, world_size, seq_length, device, act_bytes, runtime or Runtime(),
                     full_search, trainable_params, fused_loss)

    candidates: list[LayoutEstimate] = []
    excluded: list[tuple[str, str]] = []
    # Context parallelism is searched for long sequences: when the config asks for it, when the sequence is long
    # for the model (see _long_sequence), or when no layout without it fits. For shorter sequences splitting the
    # batch gives the same work per rank without the key/value traffic.
    with_context = base.context_parallel > 1
    search.layouts(global_batch, per_device_batch, candidates, excluded, sizes="all" if with_context else "one")
    if not with_context and (_long_sequence(shape, seq_length) or not any(c.fits for c in candidates)):
        search.layouts(global_batch, per_device_batch, candidates, excluded, sizes="above_one")
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
    # Within one (dp, tp, pp, ep) of an in-run plan: the ZeRO stage and recompute asked for when they fit (raised
    # only as far as memory requires), the fastest of those; if none fits, the smallest.
    if est.fits:
        return (0, est.changes, est.time.total, est.memory.total)
    return (1, est.memory.total, est.time.total, est.changes)


def _variant_key_full(est: LayoutEstimate) -> tuple[Any, ...]:
    # The plan command's search: the fastest variant that fits, whatever it changes; if none fits, the smallest.
    if est.fits:
        return (0, est.time.total, est.changes, est.memory.total)
    return (1, est.memory.total, est.time.total, est.changes)


def _long_sequence(shape: ModelShape, seq: int) -> bool:
    """Whether ``seq`` tokens are a long sequence for the model: attention's FLOPs per token (``12·L·q_width·s``)
    reach the matrix products' (``6·N``), i.e. ``s >= N / (2·L·q_width)``: about 19K tokens for Llama 3.2 1B, 29K for
    Llama 3.1 8B, 98K for Llama 3 405B. There a sequence's activations dominate and the ring's key/value transfers hide behind
    attention, as in the published long-context runs (Llama 3's CP16 at 128K, not at 8K)."""
    return shape.flops_per_token(seq) >= 2 * shape.flops_per_token(0)


@dataclass
class _Search:
    """What every layout of one planning run shares."""

    base: ParallelConfig
    shape: ModelShape
    model_config: Any
    world: int
    seq: int
    device: DeviceSpec
    act_bytes: int
    runtime: Runtime
    full_search: bool
    trainable_params: int | None = None
    fused_loss: bool = False

    def __post_init__(self) -> None:
        self.flops_per_token = self.shape.flops_per_token(self.seq)
        # validate_for reads sizes off the model config; a shape answers with the same names.
        self.model_view = self.model_config if not isinstance(self.model_config, (dict, ModelShape)) \
            else _ShapeView(self.shape)

    def layouts(self, global_batch: int | None, per_device_batch: int | None, candidates: list[LayoutEstimate],
                excluded: list[tuple[str, str]], sizes: str) -> None:
        """Estimate every (dp, cp, tp, pp, ep) layout of the world into ``candidates`` (the refused ones into
        ``excluded``) whose context-parallel size is ``"one"``, ``"above_one"`` or ``"all"``."""
        world, device, base = self.world, self.device, self.base
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                for cp in _divisors(world // (tp * pp)):
                    if (sizes == "one" and cp > 1) or (sizes == "above_one" and cp == 1):
                        continue
                    dp = world // (tp * pp * cp)
                    name = f"dp={dp}" + (f" cp={cp}" if cp > 1 else "") + f" tp={tp} pp={pp}"
                    if tp > device.devices_per_node:
                        excluded.append((name, f"model_parallel={tp} spans nodes (devices_per_node="
                                               f"{device.devices_per_node}); tensor parallelism stays within a node"))
                        continue
                    if global_batch is not None and global_batch % dp:
                        excluded.append((name, f"global_batch={global_batch} is not divisible by data_parallel={dp}"))
                        continue
                    batch = per_device_batch if per_device_batch is not None else global_batch // dp
                    experts = _expert_parallel_choices(base, self.shape, dp * cp, self.full_search)
                    if not experts:
                        excluded.append((name, f"expert_parallel={base.expert_parallel} does not divide the "
                                               f"{dp * cp} data (x context) parallel ranks and the model's "
                                               f"{self.shape.experts} experts"))
                        continue
                    for ep in experts:
                        for algo in self.context_algos(cp):
                            variants, reason = self.variants(dp, tp, pp, ep, batch, cp, algo)
                            label = name + (f"({algo})" if cp > 1 else "") + (f" ep={ep}" if ep > 1 else "")
                            if not variants:
                                excluded.append((label, reason))
                                continue
                            candidates.append(min(variants, key=_variant_key_full if self.full_search else _variant_key))

    def context_algos(self, cp: int) -> list[str]:
        """Context-parallel algorithms to try with ``cp`` ranks: the base config's; with ``full_search`` every one
        (those a model cannot run are refused by validation)."""
        if cp == 1:
            return [self.base.context_parallel_algo]
        if self.full_search:
            return ["ring", "ulysses", "hybrid"]
        return [self.base.context_parallel_algo]

    def variants(self, dp: int, tp: int, pp: int, ep: int, batch: int, cp: int = 1,
                 algo: str = "ring") -> tuple[list[LayoutEstimate], str]:
        """Every (micro-batches, schedule, ZeRO stage, recompute) variant of one layout, estimated; or the reason
        none is valid."""
        base = self.base
        zero_levels = _escalations(base.optimizer_shard, (0, 1, 2, 3)) if dp * cp > 1 else [base.optimizer_shard]
        recomputes = self.recompute_choices()
        micro_choices = _micro_batch_choices(pp, batch)
        if not micro_choices:
            return [], f"per-rank batch {batch} cannot be split into >= {pp} micro-batches"
        extra: dict[str, Any] = {}
        if self.full_search and tp > 1:
            # No sequence parallelism for experts (their router statistics need whole sequences) nor for
            # encoder-decoders: it is refused for both; nor for a model whose fixed token count (ViT's patches)
            # tensor parallelism does not divide (text is padded to a multiple of tp; images cannot be).
            fixed = getattr(self.model_view, "fixed_sequence_length", None)
            splits = not isinstance(fixed, int) or fixed % tp == 0
            extra = {"use_seq_parallel": splits and not (self.shape.is_moe or self.shape.encoder_layers),
                     "vocab_emb_dp": False}
        out: list[LayoutEstimate] = []
        reason = ""
        for schedule, vpp in _schedules(base, self.shape, pp, self.full_search):
            for micro in micro_choices:
                fields: dict[str, Any] = {"micro_batch_num": micro, "pipeline_schedule": schedule,
                                          "virtual_pipeline_stages": vpp, "expert_parallel": ep,
                                          "context_parallel": cp, "context_parallel_algo": algo,
                                          "ulysses_degree_in_cp": None, **extra,
                                          # asked for, a frozen head is split where it can be (no tp, no pp; ZeRO-0)
                                          "shard_frozen_head": base.shard_frozen_head and tp == 1 and pp == 1}
                try:
                    layout = base.with_layout(dp, tp, pp, **fields)
                    layout.validate()
                    layout.validate_for(self.world, self.model_view, per_device_batch=batch,
                                        sequence_length=self.seq if cp > 1 else None)
                except ConfigError as err:
                    reason = str(err)
                    continue
                for zero in zero_levels:
                    for recompute in recomputes:
                        config = dataclasses.replace(layout, optimizer_shard=zero, recompute=recompute,
                                                     shard_frozen_head=layout.shard_frozen_head and zero == 0)
                        out.append(self.estimate(config, batch, int(zero != base.optimizer_shard)
                                                 + int(recompute is not base.recompute)))
        return out, reason

    def recompute_choices(self) -> list[RecomputeConfig]:
        """The base config's recompute and every level above it; the full search also tries re-running the MLP
        with the attention core (a mixture of experts keeps ``top_k`` copies of each token's MLP activations)."""
        base = self.base.recompute
        choices = [base if level == base.recompute else RecomputeConfig(recompute=level)
                   for level in _escalations(base.recompute, RECOMPUTE_LEVELS)]
        if self.full_search and "selective" in [c.recompute for c in choices]:
            choices.append(RecomputeConfig(recompute="selective", select_recompute=("attention_core", "mlp")))
        return choices

    def estimate(self, config: ParallelConfig, batch: int, changes: int) -> LayoutEstimate:
        """Memory and time of one fully specified layout."""
        # A runtime that writes the attention scores to memory also keeps them for backward.
        memory = estimate_memory(self.shape, config, batch, self.seq, self.act_bytes,
                                 attention_scores=self.runtime.attention == "materialized",
                                 kv_exchange=self.runtime.context_kv, trainable_params=self.trainable_params,
                                 runtime_bytes=self.device.runtime_bytes,
                                 mapped_embedding=self.device.maps_frozen_weights, fused_loss=self.fused_loss)
        time = estimate_step_time(self.shape, config, batch, self.seq, self.device, self.act_bytes, self.runtime)
        return LayoutEstimate(config, batch, memory, time, memory.total <= self.device.usable_bytes, changes,
                              self.seq, self.flops_per_token)


@dataclass(frozen=True)
class _ShapeView:
    """A :class:`ModelShape` seen through the config field names :meth:`ParallelConfig.validate_for` checks."""

    shape: ModelShape

    @property
    def num_attention_heads(self) -> int:
        return self.shape.heads

    @property
    def num_key_value_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def intermediate_size(self) -> int:
        return math.gcd(self.shape.ffn, self.shape.routed_ffn, self.shape.shared_expert_ffn or self.shape.ffn)

    @property
    def vocab_size(self) -> int | None:
        return self.shape.vocab or None

    @property
    def num_hidden_layers(self) -> int:
        return self.shape.total_layers

    @property
    def num_experts(self) -> int | None:
        return self.shape.experts if self.shape.is_moe else None

    @property
    def attention_dropout(self) -> float:
        return 0.1 if self.shape.dropout else 0.0

    @property
    def fixed_sequence_length(self) -> int | None:
        return self.shape.max_positions if self.shape.patch_inputs else None

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.shape.encoder_layers)

    @property
    def model_type(self) -> str:
        return self.shape.model_type


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
    summary: list[str] | None = None,
    trainable_params: int | None = None,
    fused_loss: bool = False,
) -> ParallelConfig:
    """The layout to run an ``auto_parallel`` config with: :func:`plan`, logged as a table; other modes are
    returned unchanged.

    ``memory_budget`` (bytes or ``"6GiB"``) overrides the detected memory per rank; ``device`` overrides all
    device assumptions. When a process group is already running, rank 0 plans (free memory differs a little
    between devices, and every rank must run the same layout) and the others receive its answer. The rank that
    planned appends the plan's one-line reason (:meth:`AutoParallelPlan.summary`) to ``summary`` when given.
    ``trainable_params`` is a peft adapter's count (gradients and optimizer state for those alone); ``fused_loss``
    the run's ``TrainingArguments.fused_loss``.
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
                          act_bytes=act_bytes, trainable_params=trainable_params, fused_loss=fused_loss)
            (log or logger).info("%s", result.table())
            answer = [result.config.to_dict()]
            if summary is not None:
                summary.append(result.summary())
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
