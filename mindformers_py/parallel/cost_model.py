"""The ``auto_parallel`` planner's cost model: a decoder-only transformer's sizes (:class:`ModelShape`), the
memory one rank holds at its peak (parameters, gradients, AdamW state and saved activations, under ZeRO,
recompute and pipeline schedules: :func:`estimate_memory`) and the time of one step (compute, tensor-, data- and
pipeline-parallel communication, the pipeline bubble: :func:`estimate_step_time`). The terms are described in
:mod:`mindformers_py.parallel.planner`, which compares layouts with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import ParallelConfig, RecomputeConfig
from .device_spec import DeviceSpec

FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # AdamW's exp_avg and exp_avg_sq in fp32
# Activation tensors the MLP activation function keeps for backward, counted in intermediate-size units (the
# activation's input included): transformers writes these out in Python (pow, tanh, products). ``gelu_new`` is not
# among them: layers/mlp.py runs it as one fused op that keeps only its input, the default.
ACTIVATION_SAVED_TENSORS = {"gelu_fast": 4, "gelu_python": 3, "quick_gelu": 2}
DEFAULT_ACTIVATION_SAVED = 1


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
    """Time of one step of ``parallel_config`` (see :mod:`mindformers_py.parallel.planner` for the terms)."""
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
