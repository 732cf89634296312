"""The planner's time model: the seconds of one optimizer step on the busiest pipeline rank, by cause.

Every term is a volume divided by a rate, so the model says why a layout is slow:

* **matrix products** (:func:`gemm_seconds`): a roofline per GEMM, ``max(2mnk / sustained FLOP/s, bytes moved /
  memory bandwidth)``: large products run at the device's sustained matmul rate, thin ones (small tensor-parallel
  shards, attention's per-head products with a head-size inner dimension, few tokens per expert) are limited by
  memory traffic. Fused (flash) attention runs at its own measured fraction of peak; its causal mask skips half
  the work.
* **memory-bound kernels** (norms, activations, residual adds, rotary, dropout, softmax of materialised scores,
  the loss, the optimizer step): element passes through memory, counted per op for the runtime's kernels
  (:data:`ELEMENT_PASSES`: eager PyTorch ops or fused kernels), divided by the memory bandwidth.
* **tensor parallelism**: two collectives per layer in forward (attention and MLP outputs; a third for
  cross-attention), two in backward, two more under full recompute, on ``tokens x hidden`` activations; ring
  all-reduces move ``2(t-1)/t`` of the data per rank (all-gather + reduce-scatter under sequence parallelism move
  the same). They block the compute that needs them: never overlapped.
* **expert parallelism**: an all-to-all dispatch and combine per MoE layer and pass, carrying each token's
  ``top_k`` copies; the part that stays on the rank or its node moves over the faster link.
* **data parallelism**: the gradient reduction (ZeRO-0/1: all-reduce; 2/3: reduce-scatter) overlaps the last
  micro-batch's backward when the runtime buckets it (torch DDP/FSDP2) except for the last bucket; ZeRO-1's
  parameter broadcast follows the optimizer step; ZeRO-2 gathers the parameters once per step, ZeRO-3 every
  layer in forward and backward (once per micro-batch under a pipeline schedule, which keeps what backward
  gathered), prefetched behind the compute.
* **context parallelism** (:mod:`.context_cost`): every per-token term over ``seq / cp`` tokens, attention over
  the whole sequence for the rank's queries, and the ring's key/value transfers where they outlast the attention
  they overlap, or Ulysses' all-to-alls.
* **pipeline parallelism**: each micro-batch sends its activation forward and its gradient back at every stage
  boundary (``v`` times per stage when interleaved), and the schedule leaves a bubble of ``(p-1)`` micro-batch
  times (``(p-1)/v`` interleaved, Narayanan et al. 2021) on the critical path.

Collectives run at the link's bandwidth times the device's ``bandwidth_efficiency`` (what NCCL reaches): NVLink
within a node, and across nodes the NICs of the group's ranks on one node together (one per GPU, as on DGX/HGX
systems).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import check_choice
from ..parallel.config import ParallelConfig
from .collectives import all_to_all_seconds, ring_seconds  # noqa: F401 (re-exported)
from .context_cost import attention_geometry, context_forward_backward_seconds, cross_attention_gather_seconds
from .device_spec import DeviceSpec
from .model_shape import ModelShape, recomputed_share
from .shape_readers import as_shape

ATTENTION_KERNELS = ("flash", "materialized")
CONTEXT_KV_EXCHANGES = ("ring", "allgather")
KERNEL_STYLES = ("eager", "fused")
# Passes over memory, in activation-sized elements (forward, backward) per element of the tensor each op touches.
# "eager" counts the PyTorch ops of our layers (and of HF/torchtitan-style code): RMSNorm is a cast to fp32, a
# square, a mean, a scaling, a cast back and a weight product; LayerNorm under autocast runs in fp32 between two
# casts; SwiGLU is an activation and a product; rotary is two products, a negation, a concatenation and a sum;
# the loss casts the logits to fp32 before log-softmax. "fused" counts one read and one write per kernel
# (Megatron-LM's fused LayerNorm, bias-GeLU, bias-dropout-add and scale-mask-softmax); its vocabulary-parallel
# loss still casts the logits to fp32 and runs max, subtract, exp, sum and divide over them in place.
ELEMENT_PASSES: dict[str, dict[str, tuple[float, float]]] = {
    "eager": {"rmsnorm": (18, 32), "layernorm": (10, 12), "residual": (3, 3), "dropout": (2.5, 2.5),
              "gelu": (2, 3), "swiglu": (5, 9), "rope": (10, 10), "loss": (7, 11), "embedding": (2, 3),
              "moe_permute": (4, 4)},
    "fused": {"rmsnorm": (2, 3), "layernorm": (2, 3), "residual": (3, 3), "dropout": (0.5, 0.5),
              "gelu": (2, 3), "swiglu": (3, 5), "rope": (2, 2), "loss": (19, 7), "embedding": (2, 3),
              "moe_permute": (4, 4)},
}
# Materialised attention scores: the fused scale-mask-softmax reads and writes them, its backward reads two and
# writes one; attention dropout writes a mask and the dropped scores.
SCORE_PASSES = {"softmax": (2, 3), "dropout": (2.5, 2.5)}
FLASH_BACKWARD_WORK = 2.5  # FlashAttention's backward does five of the forward's two products per tile
ADAM_BYTES_PER_PARAM = 32  # AdamW on fp32 state: read parameter, gradient and both moments, write three back


@dataclass(frozen=True)
class Runtime:
    """How the training software runs a step, as far as its time goes.

    The defaults describe mindformers_py on CUDA: eager PyTorch ops, SDPA's fused attention, gradient reduction
    bucketed behind the backward pass (DDP/FSDP2), FSDP2 parameter prefetch, torch.distributed.pipelining sending
    whole activations between stages, fp32 gradients and ZeRO-1 on ``ZeroRedundancyOptimizer`` (which broadcasts
    the updated fp32 parameters after the step). The published runs the tests check against set the fields to
    what their software did.
    """

    attention: str = "flash"
    """``"flash"``: a fused attention kernel (no score matrix in memory, the causal half skipped); ``"materialized"``:
    scores written to memory with softmax and dropout as separate kernels, every score computed (Megatron-LM
    2021)."""
    kernels: str = "eager"
    """``"eager"``: one PyTorch op per elementwise step; ``"fused"``: fused norm/activation/residual kernels (see
    :data:`ELEMENT_PASSES`)."""
    overlap_grad_reduce: bool = True
    """The gradient reduction runs in buckets during the last micro-batch's backward (torch DDP, FSDP2,
    Megatron-Core ``--overlap-grad-reduce``); else it starts after the backward pass (Megatron-LM 2021's local
    DDP)."""
    overlap_param_gather: bool = True
    """ZeRO-2/3 parameter all-gathers are prefetched behind compute (FSDP2; Megatron-Core
    ``--overlap-param-gather`` also for its ZeRO-1)."""
    overlap_p2p: bool = False
    """Stage-boundary transfers run behind the next chunk's compute (Megatron-Core's interleaved schedule); else
    the receiving stage waits for them (torch.distributed.pipelining)."""
    pipeline_scatter_gather: bool = False
    """Activations cross nodes split over the tensor-parallel ranks and are all-gathered over NVLink on arrival
    (Megatron-LM); else every tensor-parallel rank sends the whole activation."""
    grad_bytes: int = 4
    """Bytes per gradient element reduced over data parallelism (fp32; 2 for fp16 gradients)."""
    zero1_param_bytes: int = 4
    """Bytes per parameter ZeRO-1 sends back after the step (fp32 broadcast by ``ZeroRedundancyOptimizer``; 2 for
    Megatron-Core's bf16 all-gather)."""
    zero1_overlapped: bool = False
    """ZeRO-1's parameter all-gather overlaps the next forward pass (Megatron-Core's distributed optimizer with
    ``--overlap-param-gather``)."""
    context_kv: str = "ring"
    """How a context-parallel ring exchanges keys and values: ``"ring"`` (ours: point-to-point sends overlapping
    each block's attention) or ``"allgather"`` (one all-gather before attention: Llama 3, torchtitan's default)."""

    def __post_init__(self) -> None:
        check_choice("attention", self.attention, ATTENTION_KERNELS)
        check_choice("kernels", self.kernels, KERNEL_STYLES)
        check_choice("context_kv", self.context_kv, CONTEXT_KV_EXCHANGES)


@dataclass
class TimeEstimate:
    """Seconds of one optimizer step (one batch per data-parallel rank) on the busiest pipeline rank, by cause;
    communication counts only where it is not hidden behind compute."""

    compute: float
    """Matrix products and attention kernels."""
    tensor_parallel: float
    """Tensor-parallel collectives."""
    data_parallel: float
    """Gradient reduction and ZeRO parameter gathers, the part not overlapped."""
    pipeline_comm: float
    """Point-to-point activation and gradient transfers between stages."""
    bubble: float
    """Idle time of the pipeline schedule's fill and drain."""
    overhead: float
    """Fixed per-micro-batch cost (kernel launches, Python)."""
    expert_parallel: float = 0.0
    """Expert-parallel all-to-all dispatch and combine."""
    memory_bound: float = 0.0
    """Memory-bound kernels: norms, activations, residual adds, rotary, dropout, softmax, the loss."""
    optimizer: float = 0.0
    """The optimizer step (memory-bound over this rank's share of the state)."""
    context_parallel: float = 0.0
    """Context-parallel key/value transfers and all-to-alls, the part not hidden behind attention."""

    @property
    def communication(self) -> float:
        """Exposed communication of every kind."""
        return (self.tensor_parallel + self.data_parallel + self.pipeline_comm + self.expert_parallel
                + self.context_parallel)

    @property
    def total(self) -> float:
        """Sum of all causes."""
        return (self.compute + self.memory_bound + self.communication + self.bubble + self.overhead
                + self.optimizer)

    def as_dict(self) -> dict[str, float]:
        """Every term and the total, in seconds."""
        names = ("compute", "memory_bound", "tensor_parallel", "expert_parallel", "context_parallel", "data_parallel",
                 "pipeline_comm", "bubble", "optimizer", "overhead")
        return {**{name: getattr(self, name) for name in names}, "total": self.total}


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


def gemm_seconds(m: float, n: float, k: float, device: DeviceSpec, element_bytes: int, count: float = 1) -> float:
    """Time of ``count`` products of an ``m x k`` by a ``k x n`` matrix: the slower of the arithmetic at the
    sustained matmul rate and the traffic of both inputs and the output at the memory bandwidth."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    arithmetic = 2.0 * m * n * k / device.flops
    traffic = (m * k + k * n + m * n) * element_bytes / device.hbm_bandwidth if device.hbm_bandwidth else 0.0
    return count * max(arithmetic, traffic)


def _memory_seconds(elements: float, device: DeviceSpec, element_bytes: int) -> float:
    """Time of memory-bound kernels moving ``elements`` values of ``element_bytes`` each."""
    if not device.hbm_bandwidth:
        return 0.0
    return elements * element_bytes / (device.hbm_bandwidth * device.memory_efficiency)


@dataclass
class _Pass:
    """Seconds of one forward (or backward) pass of a block: matrix products and memory-bound kernels."""

    matmul: float = 0.0
    memory: float = 0.0

    def __add__(self, other: _Pass) -> _Pass:
        return _Pass(self.matmul + other.matmul, self.memory + other.memory)

    def scaled(self, factor: float) -> _Pass:
        return _Pass(self.matmul * factor, self.memory * factor)


@dataclass
class _Block:
    """Forward and backward of one part of a layer."""

    forward: _Pass
    backward: _Pass

    def __add__(self, other: _Block) -> _Block:
        return _Block(self.forward + other.forward, self.backward + other.backward)


def _elementwise(op: str, elements: float, runtime: Runtime, device: DeviceSpec, element_bytes: int) -> _Block:
    fwd, bwd = ELEMENT_PASSES[runtime.kernels][op]
    return _Block(_Pass(memory=_memory_seconds(fwd * elements, device, element_bytes)),
                  _Pass(memory=_memory_seconds(bwd * elements, device, element_bytes)))


def _gemms(shapes: list[tuple[float, float, float, float]], device: DeviceSpec, element_bytes: int) -> _Block:
    """Forward products (m, n, k, count); backward computes the input and the weight gradients, two products of
    the same size."""
    forward = sum(gemm_seconds(m, n, k, device, element_bytes, count) for m, n, k, count in shapes)
    return _Block(_Pass(matmul=forward), _Pass(matmul=2 * forward))


def _attention_core(shape: ModelShape, batch_heads: float, q_len: int, kv_len: int, causal: bool,
                    device: DeviceSpec, runtime: Runtime, element_bytes: int) -> _Block:
    """softmax(q kᵀ) v for ``batch_heads`` (micro-batch x local heads) independent heads; ``causal`` skips half of
    the work (a context-parallel rank's queries are a load-balanced share of the sequence's)."""
    d = shape.score_width / shape.heads  # the head size (the mean of the q·k and p·v sizes under latent attention)
    if runtime.attention == "flash":
        work = 4.0 * batch_heads * q_len * kv_len * d * (0.5 if causal else 1.0)
        rate = device.peak_flops * device.attention_efficiency if device.peak_flops and device.attention_efficiency \
            else device.flops
        return _Block(_Pass(matmul=work / rate), _Pass(matmul=FLASH_BACKWARD_WORK * work / rate))
    scores = batch_heads * q_len * kv_len
    products = gemm_seconds(q_len, kv_len, d, device, element_bytes, batch_heads) \
        + gemm_seconds(q_len, d, kv_len, device, element_bytes, batch_heads)
    fwd, bwd = SCORE_PASSES["softmax"]
    if shape.dropout:
        fwd, bwd = fwd + SCORE_PASSES["dropout"][0], bwd + SCORE_PASSES["dropout"][1]
    return _Block(_Pass(products, _memory_seconds(fwd * scores, device, element_bytes)),
                  _Pass(2 * products, _memory_seconds(bwd * scores, device, element_bytes)))


# ---------------------------------------------------------------------------------------------------------------
# One layer, one micro-batch, one rank
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _LayerTime:
    """One layer's parts for one micro-batch on one rank, and its collectives per pass."""

    core: _Block
    attention: _Block  # projections, norm, rotary, residual (core excluded)
    mlp: _Block
    tp_collectives: int  # per forward pass, each over tokens x hidden
    all_to_alls: int  # per forward pass, each over tokens x top_k x hidden
    context: tuple[float, float] = (0.0, 0.0)  # exposed context-parallel seconds (forward, backward)

    @property
    def total(self) -> _Block:
        return self.core + self.attention + self.mlp


def _layer_time(shape: ModelShape, kind: str, batch: int, seq: int, pc: ParallelConfig, device: DeviceSpec,
                runtime: Runtime, element_bytes: int) -> _LayerTime:
    tp, ep = pc.tp, pc.ep
    tokens = batch * seq // pc.cp  # a context-parallel rank's share of the sequence
    h = shape.hidden
    # Without sequence parallelism every tensor-parallel rank runs the hidden-size elementwise ops whole.
    h_tokens = tokens / tp if pc.sequence_parallel else tokens
    norm = "rmsnorm" if shape.rms_norm else "layernorm"

    def elementwise(op: str, elements: float) -> _Block:
        return _elementwise(op, elements, runtime, device, element_bytes)

    causal = shape.causal and kind != "encoder"
    geometry = attention_geometry(shape, pc, batch, seq, causal)
    core = _attention_core(shape, geometry.batch_heads, geometry.q_len, geometry.kv_len, geometry.causal_half, device,
                           runtime, element_bytes)
    context = context_forward_backward_seconds(shape, pc, batch, seq, device, element_bytes,
                                               core.forward.matmul, core.backward.matmul, runtime.context_kv)
    attention = _gemms(shape.attention_gemms(tokens, tp), device, element_bytes)
    attention += elementwise(norm, h_tokens * h) + elementwise("residual", h_tokens * h)
    if shape.latent_attention:  # the latents' norms (whole on every rank); rotary on the rope parts only
        attention += elementwise("rmsnorm", tokens * (shape.q_lora_rank + shape.kv_lora_rank))
        rotated = tokens * (shape.heads * shape.qk_rope_head_dim / tp + shape.qk_rope_head_dim)
        attention += elementwise("rope", rotated) if shape.rope else _Block(_Pass(), _Pass())
    elif shape.rope:
        attention += elementwise("rope", tokens * (shape.q_width + shape.kv_width) / tp)
    if shape.dropout:
        attention += elementwise("dropout", 2 * h_tokens * h)
    collectives = 2
    if kind == "cross":  # queries from the decoder, keys and values from as many encoder tokens
        core += _attention_core(shape, batch * shape.heads / tp, seq // pc.cp, seq, False, device, runtime,
                                element_bytes)
        gathered = cross_attention_gather_seconds(shape, pc, batch, seq, device, element_bytes)
        context = (context[0] + gathered[0], context[1] + gathered[1])
        attention += _gemms([(tokens, shape.q_width / tp, h, 1), (tokens, 2 * shape.kv_width / tp, h, 1),
                             (tokens, h, shape.q_width / tp, 1)], device, element_bytes)
        attention += elementwise(norm, h_tokens * h) + elementwise("residual", h_tokens * h)
        collectives += 1
    mlp = elementwise(norm, h_tokens * h) + elementwise("residual", h_tokens * h)
    act = "swiglu" if shape.gated_mlp else "gelu"
    mats_in = 2 if shape.gated_mlp else 1
    all_to_alls = 0
    if kind == "moe":
        routed = tokens * shape.top_k  # token copies this rank's experts process, balanced over the experts
        local_experts = shape.experts / ep
        per_expert = routed / local_experts
        ffn = shape.routed_ffn / tp
        mlp += _gemms([(tokens, shape.experts, h, 1), (per_expert, ffn, h, mats_in * local_experts),
                       (per_expert, h, ffn, local_experts)], device, element_bytes)
        mlp += elementwise(act, routed * ffn) + elementwise("moe_permute", routed * h)
        if shape.shared_expert_ffn:
            shared = shape.shared_expert_ffn / tp
            mlp += _gemms([(tokens, shared, h, mats_in), (tokens, h, shared, 1)], device, element_bytes)
            mlp += elementwise(act, tokens * shared)
        all_to_alls = 2 if ep > 1 else 0
    else:
        ffn = shape.ffn / tp
        mlp += _gemms([(tokens, ffn, h, mats_in), (tokens, h, ffn, 1)], device, element_bytes)
        mlp += elementwise(act, tokens * ffn)
    return _LayerTime(core, attention, mlp, collectives if tp > 1 else 0, all_to_alls, context)


def _recomputed(layer: _LayerTime, pc: ParallelConfig) -> tuple[_Pass, int, int]:
    """The forward work recompute repeats in backward for one recomputed layer, with its collectives."""
    recompute = pc.recompute
    if recompute.recompute == "full":
        return layer.total.forward, layer.tp_collectives, layer.all_to_alls
    if recompute.recompute != "selective":
        return _Pass(), 0, 0
    parts = recompute.select_recompute
    work = _Pass()
    if "self_attn" in parts:
        work = work + layer.core.forward + layer.attention.forward
    elif "attention_core" in parts:
        work = work + layer.core.forward
    if "mlp" in parts:
        work = work + layer.mlp.forward
    return work, 0, 0


# ---------------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------------


def _head_time(shape: ModelShape, tokens: int, vocab_tp: int, device: DeviceSpec, runtime: Runtime,
               element_bytes: int) -> _Block:
    """The output head and loss for one micro-batch (last pipeline stage)."""
    if shape.head == "classifier" or not shape.vocab:
        return _Block(_Pass(), _Pass())
    h = shape.hidden
    products = [(tokens, shape.vocab / vocab_tp, h, 1)]
    block = _elementwise("loss", tokens * shape.vocab / vocab_tp, runtime, device, element_bytes)
    if shape.head == "mlm":
        products.append((tokens, h, h, 1))
        block += _elementwise("layernorm", tokens * h, runtime, device, element_bytes)
    return block + _gemms(products, device, element_bytes)


def estimate_step_time(model_config: Any, parallel_config: ParallelConfig, per_device_batch: int, seq_length: int,
                       device: DeviceSpec, act_bytes: int = 4, runtime: Runtime | None = None) -> TimeEstimate:
    """Time of one step of ``parallel_config`` for ``per_device_batch`` sequences of ``seq_length`` tokens per
    data-parallel rank (see the module docstring for the terms). ``act_bytes`` is the activation and matmul
    element size (2 for bf16 training); ``runtime`` describes the training software (default: ours)."""
    shape = as_shape(model_config)
    runtime = runtime or Runtime()
    pc = parallel_config
    tp, pp, dp, vpp, micro, ep = pc.tp, pc.pp, pc.dp, pc.vpp, pc.micro_batches, pc.ep
    batch = max(per_device_batch // micro, 1)
    tokens = batch * seq_length // pc.cp  # per rank: context parallelism splits every sequence
    hidden_bytes = tokens * shape.hidden * act_bytes

    # One micro-batch through the busiest rank: its share of the layers (the mean layer for mixed stacks), plus
    # the embedding (first stage) or the head and loss (last stage), whichever is heavier.
    chunk_layers = math.ceil(shape.total_layers / (pp * vpp))
    stage_layers = chunk_layers * vpp
    share = recomputed_share(pc.recompute, chunk_layers)
    work = _Pass()
    tp_collectives = 0.0
    all_to_alls = 0.0
    context_seconds = 0.0
    bwd_work = _Pass()
    for kind, count in shape.layer_kinds():
        layer = _layer_time(shape, kind, batch, seq_length, pc, device, runtime, act_bytes)
        weight = stage_layers * count / shape.total_layers
        redo, redo_tp, redo_a2a = _recomputed(layer, pc)
        total = layer.total
        work = work + (total.forward + total.backward + redo.scaled(share)).scaled(weight)
        bwd_work = bwd_work + total.backward.scaled(weight)
        tp_collectives += weight * (2 * layer.tp_collectives + share * redo_tp)
        all_to_alls += weight * (2 * layer.all_to_alls + share * redo_a2a)
        # Recompute repeats the forward exchange of the attention it re-runs.
        parts = pc.recompute.select_recompute if pc.recompute.recompute == "selective" else ()
        redo = pc.recompute.recompute == "full" or bool({"attention_core", "self_attn"} & set(parts))
        redo_context = share * layer.context[0] if redo else 0.0
        context_seconds += weight * (layer.context[0] + layer.context[1] + redo_context)
    vocab_tp = tp if pc.vocab_parallel else 1
    head = _head_time(shape, tokens, vocab_tp, device, runtime, act_bytes)
    if shape.mtp_layers:  # each module on the last stage: its layer, its projection and the shared head again
        mtp = _layer_time(shape, shape.mtp_layer_kind(), batch, seq_length, pc, device, runtime, act_bytes)
        mtp_block = mtp.total + _gemms([(tokens, shape.hidden, 2 * shape.hidden, 1)], device, act_bytes) + head
        head = head + _Block(mtp_block.forward.scaled(shape.mtp_layers), mtp_block.backward.scaled(shape.mtp_layers))
        tp_collectives += 2 * mtp.tp_collectives * shape.mtp_layers
        all_to_alls += 2 * mtp.all_to_alls * shape.mtp_layers
    embedding = _elementwise("embedding", tokens * shape.hidden, runtime, device, act_bytes)
    ends = [head.forward + head.backward, embedding.forward + embedding.backward]
    if pp == 1:
        work = work + ends[0] + ends[1]
    else:
        work = work + max(ends, key=lambda p: p.matmul + p.memory)
    tp_seconds = tp_collectives * ring_seconds(hidden_bytes, tp, 1, device)
    if pc.vocab_parallel:  # the vocabulary-parallel embedding sums its shards
        tp_seconds += ring_seconds(hidden_bytes, tp, 1, device)
    ep_seconds = all_to_alls * all_to_all_seconds(hidden_bytes * shape.top_k, ep, tp, device)
    per_micro = work.matmul + work.memory + tp_seconds + ep_seconds + context_seconds

    # The pipeline: micro-batches back to back, the fill/drain bubble, the stage-boundary transfers.
    bubble = pipeline_comm = 0.0
    if pp > 1:
        bubble = (pp - 1) / (vpp if pc.pipeline_schedule == "interleaved_1f1b" else 1) * per_micro
        # Every micro-batch passes every stage boundary, so one boundary between nodes paces them all.
        cross_node = dp * pc.cp * tp * pp > device.devices_per_node
        if cross_node and runtime.pipeline_scatter_gather and tp > 1:
            hop = hidden_bytes / tp / (device.inter_node_bandwidth * device.bandwidth_efficiency) \
                + ring_seconds(hidden_bytes, tp, 1, device, all_reduce=False)
        else:
            link = device.inter_node_bandwidth if cross_node else device.intra_node_bandwidth
            hop = hidden_bytes / (link * device.bandwidth_efficiency)
        transfers = (micro * vpp + pp - 1) * 2
        if runtime.overlap_p2p:  # only the fill and drain transfers wait
            transfers = (pp - 1) * 2
        pipeline_comm = transfers * (hop + device.link_latency_s)

    data_parallel = _data_parallel_seconds(shape, pc, stage_layers, device, runtime, act_bytes,
                                           bwd_work.matmul + bwd_work.memory, per_micro)
    state_params = (stage_layers * shape.layer_params(tp, ep)
                    + (shape.embedding_params(vocab_tp) if pp == 1 else 0) + shape.head_params(vocab_tp))
    sharded_over = dp * pc.cp if pc.zero_stage else 1
    optimizer = _memory_seconds(state_params / sharded_over * ADAM_BYTES_PER_PARAM, device, 1)
    overhead = device.micro_batch_overhead_s * micro * vpp
    return TimeEstimate(
        compute=micro * work.matmul, tensor_parallel=micro * tp_seconds, data_parallel=data_parallel,
        pipeline_comm=pipeline_comm, bubble=bubble, overhead=overhead, expert_parallel=micro * ep_seconds,
        memory_bound=micro * work.memory, optimizer=optimizer, context_parallel=micro * context_seconds,
    )


def _data_parallel_seconds(shape: ModelShape, pc: ParallelConfig, stage_layers: int, device: DeviceSpec,
                           runtime: Runtime, act_bytes: int, backward_seconds: float, per_micro: float) -> float:
    """Exposed time of the gradient reduction and ZeRO's parameter traffic on one rank."""
    tp, ep, zero, micro = pc.tp, pc.ep, pc.zero_stage, pc.micro_batches
    dp = pc.dp * pc.cp  # context-parallel ranks reduce gradients with the data-parallel ones
    if dp == 1:
        return 0.0
    vocab_tp = tp if pc.vocab_parallel else 1
    experts = stage_layers * shape.expert_stack_params(tp, ep) / shape.total_layers
    dense = stage_layers * shape.layer_params(tp, ep) - experts
    dense += (shape.embedding_params(vocab_tp) + shape.head_params(vocab_tp)) / pc.pp
    groups = [(dense, dp, tp), (experts, dp // ep, tp * ep)]  # experts reduce over the ranks holding them
    reduce = sum(ring_seconds(params * runtime.grad_bytes, size, stride, device, all_reduce=zero < 2)
                 for params, size, stride in groups if params)
    # Buckets reduce while the last micro-batch's backward runs; the last bucket (about one layer) cannot.
    tail = reduce / max(stage_layers, 1)
    exposed = max(tail, reduce - backward_seconds) if runtime.overlap_grad_reduce else reduce
    gathers = 0.0
    if zero == 1:
        gathers = sum(ring_seconds(params * runtime.zero1_param_bytes, size, stride, device, all_reduce=False)
                      for params, size, stride in groups if params)
        gathers = 0.0 if runtime.zero1_overlapped else gathers
    elif zero >= 2:
        one = sum(ring_seconds(params * act_bytes, size, stride, device, all_reduce=False)
                  for params, size, stride in groups if params)
        # ZeRO-3 gathers each layer in forward and again in backward; under a pipeline schedule the parameters
        # gathered for backward stay (torch.distributed.pipelining), so about one gather per micro-batch.
        passes = (2 if micro == 1 else micro + 1) if zero == 3 else 1
        per_pass = per_micro / 2
        if runtime.overlap_param_gather:  # prefetched behind the compute, except the first layer's
            gathers = passes * max(one / max(stage_layers, 1), one - per_pass)
        else:
            gathers = passes * one
    return exposed + gathers
