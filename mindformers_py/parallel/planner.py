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
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .config import ParallelConfig, RecomputeConfig

logger = logging.getLogger(__name__)

GIB = 1024**3
FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # AdamW's exp_avg and exp_avg_sq in fp32
# Activation tensors the MLP activation function keeps for backward, counted in intermediate-size units (the
# activation's input included): ``gelu_new`` is written out in Python by transformers (pow, tanh, two products).
ACTIVATION_SAVED_TENSORS = {"gelu_new": 4, "gelu_fast": 4, "gelu_python": 3, "quick_gelu": 2}
DEFAULT_ACTIVATION_SAVED = 1
# Peak dense bf16 tensor-core FLOP/s of common GPUs, matched against the device name (fp32 runs use half).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40": 181e12, "A10": 125e12, "V100": 125e12,
                  "T4": 65e12}
# Peak FLOP/s reached in training (model FLOPs utilisation).
GPU_EFFICIENCY = 0.4
RECOMPUTE_LEVELS: tuple[Any, ...] = (False, "selective", "full")


# ---------------------------------------------------------------------------------------------------------------
# The device
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DeviceSpec:
    """What the planner assumes about each rank's device and links; every field can be set by hand.

    Use :meth:`detect` for the current machine.
    """

    device_type: str = "cpu"
    """``"cuda"`` or ``"cpu"``."""
    memory_bytes: int = 8 * GIB
    """Memory one rank may use (its budget)."""
    flops: float = 5e10
    """Sustained FLOP/s of one rank in training."""
    intra_node_bandwidth: float = 2e9
    """Bytes/s of a collective between ranks of one node (NVLink, PCIe or shared memory)."""
    inter_node_bandwidth: float = 1e9
    """Bytes/s of a collective between nodes."""
    devices_per_node: int = 8
    """Ranks on one node; tensor parallelism stays within a node."""
    headroom: float = 0.1
    """Fraction of ``memory_bytes`` kept free for allocator fragmentation, temporaries and the runtime."""
    micro_batch_overhead_s: float = 1e-3
    """Fixed cost of running one micro-batch through one stage (kernel launches, Python), which makes very small
    micro-batches lose."""

    @property
    def usable_bytes(self) -> int:
        """``memory_bytes`` less the headroom: what an estimate must fit in."""
        return int(self.memory_bytes * (1.0 - self.headroom))

    @classmethod
    def detect(cls, device_type: str | None = None, memory_budget: int | float | str | None = None,
               devices_per_node: int | None = None, world_size: int = 1, **overrides: Any) -> DeviceSpec:
        """The spec of this machine.

        Args:
            device_type: ``"cuda"`` or ``"cpu"`` (default: CUDA when visible).
            memory_budget: bytes per rank (an int, or a string such as ``"6GiB"``/``"512MB"``); default: the free
                memory of the current GPU (``torch.cuda.mem_get_info``), or on CPU the host's available memory
                (``MemAvailable`` in ``/proc/meminfo``) shared by the ranks of this node.
            devices_per_node: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``, else the visible GPUs on
                CUDA, else ``world_size``).
            world_size: ranks in the job, used for the CPU share and the per-node default.
            overrides: any other field (``flops``, bandwidths, ``headroom``).
        """
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if devices_per_node is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local:
                devices_per_node = int(local)
            elif device_type == "cuda" and torch.cuda.is_available():
                devices_per_node = max(torch.cuda.device_count(), 1)
            else:
                devices_per_node = max(world_size, 1)
        devices_per_node = min(devices_per_node, max(world_size, 1))
        if device_type == "cuda":
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            peak = next((f for key, f in GPU_PEAK_FLOPS.items() if key in name), 100e12)
            spec = cls(device_type="cuda", flops=peak * GPU_EFFICIENCY, intra_node_bandwidth=100e9,
                       inter_node_bandwidth=20e9, devices_per_node=devices_per_node, micro_batch_overhead_s=2e-4)
            memory = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else spec.memory_bytes
        else:
            spec = cls(device_type="cpu", devices_per_node=devices_per_node)
            available = host_available_memory()
            memory = available // devices_per_node if available else spec.memory_bytes
        if memory_budget is not None:
            memory = parse_bytes(memory_budget)
        return dataclasses.replace(spec, memory_bytes=int(memory), **overrides)


def host_available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of memory the host can give new processes (``MemAvailable``), or None when unknown."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """A memory size as bytes: a number, or a string with a unit (``"6GiB"``, ``"512 MB"``, ``"1.5gb"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if unit in _UNITS and amount > 0:
            return int(amount * _UNITS[unit])
    raise ConfigError(f"memory_budget={value!r} is not valid; expected a positive byte count such as 8589934592, "
                      "'8GiB' or '512MB'")


# ---------------------------------------------------------------------------------------------------------------
# The model, in the quantities the estimates need
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory and time depend on (read from a model config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    gated_mlp: bool
    rope: bool
    rms_norm: bool
    norm_bias: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    tied_embeddings: bool
    learned_positions: bool
    act_saved: int
    dropout: bool

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """Read a GPT-style config (HF field names; missing fields take GPT-2 defaults)."""
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        gated = bool(getattr(cfg, "gated_mlp", False))
        act = getattr(cfg, "hidden_act", "gelu_new")
        position = getattr(cfg, "position_embedding_type", "learned")
        dropout = any(float(getattr(cfg, name, 0.0) or 0.0) > 0
                      for name in ("hidden_dropout", "attention_dropout", "embedding_dropout"))
        return cls(
            hidden=hidden, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            ffn=getattr(cfg, "intermediate_size", None) or 4 * hidden, vocab=cfg.vocab_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1024), gated_mlp=gated,
            rope=position == "rope", rms_norm=getattr(cfg, "norm_type", "layernorm") == "rmsnorm",
            norm_bias=bool(getattr(cfg, "norm_bias", True)), qkv_bias=bool(getattr(cfg, "attention_bias", True)),
            out_bias=bool(getattr(cfg, "attention_out_bias", True)), mlp_bias=bool(getattr(cfg, "mlp_bias", True)),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), learned_positions=position == "learned",
            act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED), dropout=dropout,
        )

    @property
    def q_width(self) -> int:
        """Width of the query projection (heads x head size)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of each key/value projection."""
        return self.kv_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        """Parameters of one norm."""
        return self.hidden * (2 if not self.rms_norm and self.norm_bias else 1)

    def attention_params(self, tp: int = 1) -> int:
        """Parameters of one attention block on one of ``tp`` tensor-parallel ranks."""
        q, kv, h = self.q_width, self.kv_width, self.hidden
        sharded = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        return sharded // tp + (h if self.out_bias else 0)

    def mlp_params(self, tp: int = 1) -> int:
        """Parameters of one MLP on one of ``tp`` tensor-parallel ranks."""
        mats = 3 if self.gated_mlp else 2
        biases = (mats - 1) * self.ffn if self.mlp_bias else 0
        return (mats * self.hidden * self.ffn + biases) // tp + (self.hidden if self.mlp_bias else 0)

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer layer on one of ``tp`` tensor-parallel ranks."""
        return self.attention_params(tp) + self.mlp_params(tp) + 2 * self.norm_params

    def embedding_params(self, tp: int = 1) -> int:
        """Token (and learned position) embedding parameters on one of ``tp`` vocabulary shards."""
        return self.vocab * self.hidden // tp + (self.max_positions * self.hidden if self.learned_positions else 0)

    def head_params(self, tp: int = 1) -> int:
        """Final norm and LM head parameters (the head counted even when tied: pipeline stages hold a copy)."""
        return self.norm_params + self.vocab * self.hidden // tp

    def total_params(self) -> int:
        """Parameters of the whole model on one device (a tied head counted once)."""
        head = self.norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)
        return self.embedding_params() + self.layers * self.layer_params() + head

    def flops_per_token(self, seq: int, recompute: RecomputeConfig | None = None) -> float:
        """Training FLOPs per token: ``6·N`` for the matrix products (N counting the head's matmul, not the
        embedding lookups) plus ``12·L·q_width·s`` for attention scores, plus the forward re-run by recompute."""
        dense = self.layers * self.layer_params() + self.vocab * self.hidden
        attention = 12 * self.layers * self.q_width * seq
        flops = 6 * dense + attention
        if recompute is not None and recompute.enabled:
            share = _recomputed_share(recompute, self.layers)
            if recompute.recompute == "full":
                extra = 2 * self.layer_params() + 4 * self.q_width * seq
            else:
                parts = recompute.select_recompute
                extra = 4 * self.q_width * seq if parts else 0
                extra += 2 * self.attention_params() if "self_attn" in parts else 0
                extra += 2 * self.mlp_params() if "mlp" in parts else 0
            flops += share * self.layers * extra
        return float(flops)


def _recomputed_share(recompute: RecomputeConfig, layers_per_chunk: int, stage: int = 0) -> float:
    """Fraction of a chunk's layers that ``recompute`` applies to."""
    if not recompute.enabled or layers_per_chunk == 0:
        return 0.0
    chosen = sum(recompute.recomputes_layer(i, stage) for i in range(layers_per_chunk))
    return chosen / layers_per_chunk


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    """Bytes one rank holds at its peak (during backward), by kind."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """Activations saved for backward by the forward passes in flight (what ``saved_tensors_hooks`` see)."""
    recompute: int = 0
    """Activations re-materialised for one layer at a time during backward under full recompute."""

    @property
    def total(self) -> int:
        """Sum of all kinds."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.recompute


def layer_activation_bytes(shape: ModelShape, tokens: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str | bool = False, select: Sequence[str] = (), act_bytes: int = FP32_BYTES,
                           attention_scores: bool = False, seq: int = 0) -> int:
    """Bytes one transformer layer saves for backward for ``tokens`` tokens (micro-batch x sequence).

    Counted op by op for :class:`~mindformers_py.layers.TransformerBlock` (and checked against autograd's saved
    tensors in the tests): each norm keeps its input, its statistics and its output (RMSNorm also the normalised
    value before the scale); q/k/v projections share the normed input; rotary keeps only its cos/sin tables (the
    rotated q, k need no saved input); SDPA keeps q, the head-expanded k and v, its output (which ``o_proj`` keeps
    as its input too) and the log-sum-exp per head; the MLP its normed input and, per intermediate-size tensor,
    what the activation and the gating product keep. Tensors split by heads or FFN across ``tp`` ranks count 1/tp;
    hidden-size tensors count 1/tp only with sequence parallelism. ``attention_scores`` adds the softmax
    probabilities (``b·heads·s²``) that SDPA's math path keeps (e.g. a CPU run with a padding mask);
    flash/efficient kernels keep none.

    ``recompute="full"`` keeps only the layer's input; ``"selective"`` re-runs the parts in ``select``.
    """
    h_div = tp if sequence_parallel else 1
    hidden = shape.hidden * tokens // h_div
    q = shape.q_width * tokens // tp
    kv = shape.kv_width * tokens // tp
    ffn = shape.ffn * tokens // tp
    if recompute == "full":
        return hidden * act_bytes
    stats = tokens // h_div * (1 if shape.rms_norm else 2)  # rsqrt, or mean and rstd, per token
    norm = hidden * (3 if shape.rms_norm else 2) + stats
    lse = shape.heads * tokens // tp
    core = 3 * q + lse  # q, k and v expanded to the query heads, log-sum-exp
    output = q  # SDPA's output, also o_proj's input
    scores = shape.heads * tokens * seq // tp if attention_scores and seq else 0
    mlp = (shape.act_saved + (3 if shape.gated_mlp else 1)) * ffn
    dropout_masks = (2 * hidden + scores) // act_bytes if shape.dropout else 0  # bool masks, one byte each
    if recompute == "selective":
        if "self_attn" in select:
            core, output, scores = 0, 0, 0  # only the normed input, counted in ``norm``
        elif "attention_core" in select:
            core, scores = q + 2 * kv, 0  # the checkpoint keeps its inputs q, k, v
        if "mlp" in select:
            mlp = 0  # only the normed input, counted in ``norm``
    return (2 * norm + core + output + scores + mlp + dropout_masks) * act_bytes


def _in_flight(schedule: str, pp: int, micro: int, vpp: int, first: bool) -> float:
    """Micro-batches whose activations a pipeline rank keeps at once (the first rank is the busiest)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro)
    if not first:
        return 1.0
    if schedule == "interleaved_1f1b":  # Narayanan et al. 2021: p micro-batches x (1 + (p-1)/(p·v))
        return min(float(micro), pp * (1.0 + (pp - 1) / (pp * vpp)))
    return float(min(pp, micro))


def estimate_memory(model_config: Any, parallel_config: ParallelConfig, per_device_batch: int, seq_length: int,
                    act_bytes: int = FP32_BYTES, attention_scores: bool = False) -> MemoryEstimate:
    """Peak bytes on the busiest rank of ``parallel_config`` for a data-parallel rank batch of
    ``per_device_batch`` sequences of ``seq_length`` tokens, fp32 parameters and AdamW.

    ``act_bytes`` is the activation element size (2 under bf16 autocast); ``attention_scores`` counts SDPA's
    kept softmax (see :func:`layer_activation_bytes`).
    """
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    pc = parallel_config
    tp, pp, dp, vpp, micro = pc.tp, pc.pp, pc.dp, pc.vpp, pc.micro_batches
    vocab_tp = tp if pc.vocab_parallel else 1
    chunks = pp * vpp
    layers_per_chunk = math.ceil(shape.layers / chunks)
    tokens = per_device_batch // micro * seq_length
    recompute = pc.recompute
    select = tuple(recompute.select_recompute) if recompute.recompute == "selective" else ()

    best: MemoryEstimate | None = None
    for first in (True, False) if pp > 1 else (True,):
        last = not first or pp == 1
        params = vpp * layers_per_chunk * shape.layer_params(tp)
        params += shape.embedding_params(vocab_tp) if first else 0
        if last:
            tied_single = pp == 1 and shape.tied_embeddings
            params += shape.norm_params if tied_single else shape.head_params(vocab_tp)
        layer_full = layer_activation_bytes(shape, tokens, tp, pc.sequence_parallel, False, (), act_bytes,
                                            attention_scores, seq_length)
        layer_kept = layer_activation_bytes(shape, tokens, tp, pc.sequence_parallel, recompute.recompute, select,
                                            act_bytes, attention_scores, seq_length)
        share = _recomputed_share(recompute, layers_per_chunk, 0 if first else pp - 1)
        per_chunk = layers_per_chunk * (share * layer_kept + (1 - share) * layer_full)
        acts = _in_flight(pc.pipeline_schedule, pp, micro, vpp, first) * vpp * per_chunk
        rematerialised = layer_full if share > 0 and recompute.recompute == "full" else 0
        if last:  # final norm (its output is the head's input), fp32 log-softmax over the vocabulary
            flight = _in_flight(pc.pipeline_schedule, pp, micro, vpp, first=pp == 1)
            norm = (3 if shape.rms_norm else 2) * shape.hidden * tokens * act_bytes
            acts += flight * (norm + tokens * shape.vocab // vocab_tp * FP32_BYTES)
        estimate = _state_bytes(params, shape.layer_params(tp), dp, pc.zero_stage, int(acts))
        estimate.recompute = rematerialised
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None
    return best


def _state_bytes(params: int, layer_params: int, dp: int, zero: int, activations: int) -> MemoryEstimate:
    """Parameters, gradients and AdamW state of ``params`` fp32 parameters under ZeRO ``zero`` over ``dp``."""
    full = params * FP32_BYTES
    if dp == 1 or zero == 0:
        return MemoryEstimate(full, full, params * ADAM_STATE_BYTES, activations)
    optimizer = params * ADAM_STATE_BYTES // dp
    if zero == 1:
        return MemoryEstimate(full, full, optimizer, activations)
    if zero == 2:  # sharded storage + whole parameters kept from forward through backward
        return MemoryEstimate(full + full // dp, full // dp, optimizer, activations)
    # zero 3: shards + two layers gathered at a time (the running one and the prefetched one)
    return MemoryEstimate(full // dp + 2 * layer_params * FP32_BYTES, full // dp, optimizer, activations)


# ---------------------------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TimeEstimate:
    """Seconds of one optimizer step (one batch per data-parallel rank), by cause; nothing overlaps."""

    compute: float
    tensor_parallel: float
    data_parallel: float
    pipeline_comm: float
    bubble: float
    overhead: float

    @property
    def total(self) -> float:
        """Sum of all causes."""
        return (self.compute + self.tensor_parallel + self.data_parallel + self.pipeline_comm + self.bubble
                + self.overhead)


def estimate_step_time(model_config: Any, parallel_config: ParallelConfig, per_device_batch: int, seq_length: int,
                       device: DeviceSpec, act_bytes: int = FP32_BYTES) -> TimeEstimate:
    """Time of one step of ``parallel_config`` (see the module docstring for the terms)."""
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    pc = parallel_config
    tp, pp, dp, vpp, micro = pc.tp, pc.pp, pc.dp, pc.vpp, pc.micro_batches
    world = tp * pp * dp
    tokens_rank = per_device_batch * seq_length  # per data-parallel rank and step
    compute = shape.flops_per_token(seq_length, pc.recompute) * tokens_rank * dp / (world * device.flops)

    per_node = device.devices_per_node
    tp_bw = device.intra_node_bandwidth
    dp_bw = device.intra_node_bandwidth if dp * tp <= per_node else device.inter_node_bandwidth
    pp_bw = device.intra_node_bandwidth if world <= per_node else device.inter_node_bandwidth
    layers_rank = shape.layers / pp
    hidden_bytes = tokens_rank * shape.hidden * act_bytes  # one activation of the whole rank batch
    tensor_parallel = 0.0
    if tp > 1:
        # Two all-reduces (or all-gather + reduce-scatter) per layer in forward, two in backward, one more
        # forward's worth under full recompute; a ring moves 2(t-1)/t of the data per rank.
        collectives = 4 + (2 * _recomputed_share(pc.recompute, shape.layers) if pc.recompute.recompute == "full"
                           else 0)
        tensor_parallel = collectives * layers_rank * 2 * (tp - 1) / tp * hidden_bytes / tp_bw
    data_parallel = 0.0
    if dp > 1:
        params_rank = shape.layers / pp * shape.layer_params(tp) + shape.embedding_params(tp if pc.vocab_parallel
                                                                                           else 1) / pp
        # all-reduce = reduce-scatter + all-gather; ZeroRedundancyOptimizer (ZeRO-1) broadcasts the updated
        # parameters too; ZeRO-3 gathers parameters again in backward.
        passes = {0: 2, 1: 3, 2: 2, 3: 3}[pc.zero_stage]
        data_parallel = passes * (dp - 1) / dp * params_rank * FP32_BYTES / dp_bw
    pipeline_comm = 0.0
    bubble = 0.0
    if pp > 1:
        pipeline_comm = 2 * hidden_bytes / pp_bw  # activations forward, their gradients backward
        bubble = compute * (pp - 1) / (micro * (vpp if pc.pipeline_schedule == "interleaved_1f1b" else 1))
    overhead = device.micro_batch_overhead_s * micro * vpp
    return TimeEstimate(compute, tensor_parallel, data_parallel, pipeline_comm, bubble, overhead)


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
