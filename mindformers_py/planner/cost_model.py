"""The planner's memory model: the bytes one rank holds at its peak (parameters, gradients, AdamW state and saved
activations, under ZeRO, expert parallelism, recompute and pipeline schedules: :func:`estimate_memory`).

The model's sizes come from :mod:`.model_shape`; the time of a step is :mod:`.step_time`'s. Both are re-exported
here, where the planner and the benchmarks import them. The terms are described in
:mod:`mindformers_py.planner.search`, which compares layouts with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..layers.loss.linear_cross_entropy import CHUNK_ELEMENTS
from ..parallel.config import ParallelConfig
from ..parallel.layout import FSDP
from .context_cost import context_buffer_bytes
from .model_shape import ACTIVATION_SAVED_TENSORS, DEFAULT_ACTIVATION_SAVED, ModelShape, recomputed_share
from .shape_readers import as_shape
from .step_time import Runtime, TimeEstimate, estimate_step_time

__all__ = [
    "ACTIVATION_SAVED_TENSORS", "ADAM_STATE_BYTES", "DEFAULT_ACTIVATION_SAVED", "FP32_BYTES", "MemoryEstimate",
    "ModelShape", "Runtime", "TimeEstimate", "as_shape", "estimate_memory", "estimate_step_time",
    "layer_activation_bytes",
]

FP32_BYTES = 4
# Parameters, their gradients and AdamW's two moments are fp32 (bf16 training runs under autocast with fp32
# master weights): 16 bytes per parameter, as Megatron-LM's fp16/bf16 training keeps them (fp16 copy + fp16
# gradient + fp32 master + two fp32 moments).
ADAM_STATE_BYTES = 8  # AdamW's exp_avg and exp_avg_sq in fp32


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
    context: int = 0
    """Key/value blocks a context-parallel attention holds in flight for one layer at a time."""
    logits_gradient: int = 0
    """The gradient of one micro-batch's logits as backward starts, in fp32 and again in the compute dtype, beside
    everything saved: at a 128K vocabulary the largest single term of a 1B model's step (8 bytes of 6 per token and
    vocabulary entry under bf16)."""
    runtime: int = 0
    """What the process holds before any model tensor: the framework, its libraries and the data
    (:attr:`~.device_spec.DeviceSpec.runtime_bytes`)."""

    @property
    def total(self) -> int:
        """Sum of all kinds."""
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.recompute + self.context
                + self.logits_gradient + self.runtime)


# Input-sized tensors an RMSNorm keeps for backward, its output included (which its consumer keeps), on plain
# tensors and on DTensors: layers.norms' hand-written backward keeps the input alone; a DTensor norm (sequence
# parallelism's, the per-head norms' under tensor parallelism) runs autograd's ops, which keep the normalised
# value too.
_RMS_NORM_KEPT = {False: 2, True: 3}


def _norm_kept(shape: ModelShape, sharded: bool) -> int:
    """Input-sized tensors one of the model's norms keeps, its output included; LayerNorm keeps its input and output."""
    return _RMS_NORM_KEPT[sharded] if shape.rms_norm else 2


def layer_activation_bytes(shape: ModelShape, tokens: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str | bool = False, select: Sequence[str] = (), act_bytes: int = FP32_BYTES,
                           attention_scores: bool = False, seq: int = 0, kind: str = "dense") -> int:
    """Bytes one transformer layer saves for backward for ``tokens`` tokens (micro-batch x sequence).

    Counted op by op for :class:`~mindformers_py.layers.TransformerBlock` (and checked against autograd's saved
    tensors in the tests): each norm keeps its input, its statistics and its output (an RMSNorm on DTensors, under
    sequence parallelism, also the normalised value before the scale: ``_RMS_NORM_KEPT``); q/k/v projections share
    the normed input; rotary keeps only its cos/sin tables (the rotated q, k need no saved input); SDPA keeps q,
    the head-expanded k and v, its output (which ``o_proj`` keeps as its input too) and the log-sum-exp per head;
    the MLP its normed input and, per intermediate-size tensor, what the activation and the gating product keep.
    Tensors split by heads or FFN across ``tp`` ranks count 1/tp; hidden-size tensors count 1/tp only with sequence
    parallelism. ``attention_scores`` adds the softmax probabilities (``b·heads·s²``) that SDPA's math path keeps
    (e.g. a CPU run with a padding mask); flash/efficient kernels keep none.

    ``kind`` (see :meth:`ModelShape.layer_kinds`) is ``"dense"`` or ``"encoder"``, ``"moe"`` (the MLP replaced by a router and ``top_k`` experts per token, which keep
    the routed copies of their inputs and outputs and the router's logits and probabilities) or ``"cross"`` (a
    decoder layer of an encoder-decoder model: a dense layer plus a cross-attention block over as many encoder
    tokens). ``recompute="full"`` keeps only the layer's input; ``"selective"`` re-runs the parts in ``select``.
    """
    h_div = tp if sequence_parallel else 1
    hidden = shape.hidden * tokens // h_div
    q = shape.q_width * tokens // tp
    kv = shape.kv_width * tokens // tp
    ffn = shape.ffn * tokens // tp
    if recompute == "full":
        return hidden * act_bytes
    stats = tokens // h_div * (1 if shape.rms_norm else 2)  # rsqrt, or mean and rstd, per token
    norm = hidden * _norm_kept(shape, sharded=sequence_parallel and tp > 1) + stats
    lse = shape.heads * tokens // tp
    v = shape.v_width * tokens // tp
    core = 2 * q + v + lse  # q, k and v expanded to the query heads, log-sum-exp
    output = v  # SDPA's output, also o_proj's input
    # Latent attention's latents, whole on every rank (their norms on plain tensors): the normed query and key/value
    # latents (input, output) and the shared rope key.
    latent = (2 * shape.q_lora_rank + 2 * shape.kv_lora_rank + shape.qk_rope_head_dim) * tokens \
        if shape.latent_attention else 0
    scores = shape.heads * tokens * seq // tp if attention_scores and seq else 0
    # per-head RMSNorms of q and k: each keeps its input (and on DTensors, under tensor parallelism, its normalised
    # value; rotary keeps neither) and a statistic
    qk_norms = (_RMS_NORM_KEPT[tp > 1] - 1) * (q + kv) + (shape.heads + shape.kv_heads) * tokens // tp \
        if shape.qk_norm else 0
    per_ffn = shape.act_saved + (3 if shape.gated_mlp else 1)
    mlp = per_ffn * ffn
    if kind == "moe":
        routed = shape.top_k * tokens
        mlp = per_ffn * routed * shape.routed_ffn // tp + 2 * routed * shape.hidden + 2 * tokens * shape.experts
        mlp += per_ffn * shape.shared_expert_ffn * tokens // tp
    cross = norm + 2 * q + 2 * kv + lse + q if kind == "cross" else 0  # normed input, q, k, v, output, lse
    dropout_masks = (2 * hidden + scores) // act_bytes if shape.dropout else 0  # bool masks, one byte each
    if recompute == "selective":
        if "self_attn" in select:
            core, output, scores, qk_norms, latent = 0, 0, 0, 0, 0  # only the normed inputs
            cross = norm if cross else 0
        elif "attention_core" in select:
            # the checkpoint keeps its inputs q, k, v (latent attention's values have heads of their own size)
            core, scores = q + kv + (v if shape.latent_attention else kv), 0
        if "mlp" in select:
            mlp = 0  # only the normed input, counted in ``norm``
    return (2 * norm + core + qk_norms + latent + output + scores + mlp + cross + dropout_masks) * act_bytes


def _mean_layer_activation_bytes(shape: ModelShape, *args: Any) -> float:
    """:func:`layer_activation_bytes` averaged over the layer kinds of ``shape`` (exact for uniform stacks)."""
    kinds = shape.layer_kinds()
    if len(kinds) == 1:
        return float(layer_activation_bytes(shape, *args, kind=kinds[0][0]))
    total = sum(count * layer_activation_bytes(shape, *args, kind=kind) for kind, count in kinds)
    return total / shape.total_layers


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
                    act_bytes: int = FP32_BYTES, attention_scores: bool = False,
                    kv_exchange: str = "ring", trainable_params: int | None = None,
                    param_bytes: int = FP32_BYTES, runtime_bytes: int = 0,
                    mapped_embedding: bool = False, fused_loss: bool = False) -> MemoryEstimate:
    """Peak bytes on the busiest rank of ``parallel_config`` for a data-parallel rank batch of
    ``per_device_batch`` sequences of ``seq_length`` tokens, fp32 parameters and AdamW.

    ``model_config`` is a :class:`ModelShape`, an HF ``config.json`` dict or a GPT-style config. ``act_bytes`` is
    the activation element size (2 under bf16 autocast); ``attention_scores`` counts SDPA's kept softmax (see
    :func:`layer_activation_bytes`). Heterogeneous stacks (MoE every few layers, encoder-decoders) are counted
    with their mean layer; expert parameters and their state are split over ``expert_parallel`` ranks and sharded
    by ZeRO over the remaining ``data_parallel / expert_parallel`` ranks. Under context parallelism a rank keeps
    the activations of ``seq_length / context_parallel`` tokens, ZeRO shards over data x context parallel ranks, and
    one layer's key/value blocks in flight are added (``kv_exchange`` as :attr:`Runtime.context_kv`; see
    :mod:`.context_cost`). ``trainable_params`` (a peft adapter's trainable parameters) keeps gradients and AdamW
    state for those alone, spread over the ranks like the model's own (the frozen base is held and sharded as
    before). ``param_bytes`` is the size the parameters are held in (2 for a model loaded in bf16; gradients and
    AdamW state stay fp32). ``runtime_bytes`` is what the process holds besides (its device's
    :attr:`~.device_spec.DeviceSpec.runtime_bytes`). ``mapped_embedding``: the frozen base's input embedding stays a
    view of the checkpoint's mapped file (:attr:`~.device_spec.DeviceSpec.maps_frozen_weights`), so only the rows a
    step looks up are resident; counted so for an adapter's run where the table is neither sharded by ZeRO-3 (FSDP2
    copies its shard), nor a tensor-parallel DTensor (read out of the file), nor tied to the head (whose product reads
    every row). ``fused_loss`` (``TrainingArguments.fused_loss``): where the model can fold its head into the loss
    (a language-model head on one pipeline stage: see :func:`_head_fusable`; frozen means an adapter's run), one
    chunk of logits exists instead of all of them and their gradient.

    Under ZeRO-3 the busiest moment of a rank is FSDP2 making its largest unit whole (a layer, or the input
    embedding or output head, which are units of their own): the gathered buffer and the parameter copied out of it
    exist together, twice the unit in the dtype it is gathered in (measured on a 128K-vocabulary 1B model: +0.98
    GiB as its 0.49 GiB bf16 embedding was gathered).
    """
    shape = as_shape(model_config)
    pc = parallel_config
    tp, pp, vpp, micro, ep = pc.tp, pc.pp, pc.vpp, pc.micro_batches, pc.ep
    dp = pc.dp * pc.cp  # ZeRO shards over data x context parallel ranks (FSDP's mesh folds cp in)
    vocab_tp = tp if pc.vocab_parallel else 1
    chunks = pp * vpp
    layers_per_chunk = math.ceil(shape.total_layers / chunks)
    tokens = per_device_batch // micro * seq_length // pc.cp  # a context-parallel rank's share of each sequence
    recompute = pc.recompute
    select = tuple(recompute.select_recompute) if recompute.recompute == "selective" else ()
    head_fused = fused_loss and shape.head == "lm" and pp == 1 and _head_fusable(pc, dp, vocab_tp,
                                                                               trainable_params is not None)
    # a frozen head split by rows over the dp x cp ranks (shard_frozen_head: an adapter's run, untied)
    head_ranks = dp if pc.frozen_head_sharded and trainable_params is not None and not shape.tied_embeddings else 1
    layer_params = shape.layer_params(tp, ep)
    layer_experts = shape.expert_stack_params(tp, ep) / shape.total_layers

    best: MemoryEstimate | None = None
    for first in (True, False) if pp > 1 else (True,):
        last = not first or pp == 1
        stage_layers = vpp * layers_per_chunk
        params = stage_layers * layer_params
        params += shape.embedding_params(vocab_tp) if first else 0
        if last:
            tied_single = pp == 1 and shape.tied_embeddings and shape.head != "classifier"
            params += shape.head_params(vocab_tp) // head_ranks \
                - (shape.vocab * shape.hidden // vocab_tp if tied_single else 0)
            params += shape.mtp_params(tp, ep)
        layer_args = (tokens, tp, pc.sequence_parallel)
        layer_full = _mean_layer_activation_bytes(shape, *layer_args, False, (), act_bytes, attention_scores,
                                                  seq_length)
        layer_kept = _mean_layer_activation_bytes(shape, *layer_args, recompute.recompute, select, act_bytes,
                                                  attention_scores, seq_length)
        share = recomputed_share(recompute, layers_per_chunk, 0 if first else pp - 1)
        per_chunk = layers_per_chunk * (share * layer_kept + (1 - share) * layer_full)
        acts = _in_flight(pc.pipeline_schedule, pp, micro, vpp, first) * vpp * per_chunk
        rematerialised = int(layer_full) if share > 0 and recompute.recompute == "full" else 0
        if last:
            flight = _in_flight(pc.pipeline_schedule, pp, micro, vpp, first=pp == 1)
            acts += flight * _head_activation_bytes(shape, tokens, vocab_tp, act_bytes, head_fused, head_ranks,
                                                    pc.sequence_parallel and tp > 1) \
                * (1 + shape.mtp_layers)
            if head_ranks > 1 and not head_fused:  # the split head's own forward gathers its weight for the call
                acts += shape.vocab * shape.hidden * param_bytes
            if shape.mtp_layers:  # each module's layer, its input norms and projection (2·hidden in, hidden out)
                mtp_layer = layer_activation_bytes(shape, tokens, tp, pc.sequence_parallel, False, (), act_bytes,
                                                   attention_scores, seq_length, kind=shape.mtp_layer_kind())
                acts += flight * shape.mtp_layers * (mtp_layer + 9 * shape.hidden * tokens * act_bytes)
        experts = int(stage_layers * layer_experts) + (shape.mtp_expert_params(tp, ep) if last else 0)
        units = [layer_params]  # what FSDP2 gathers at once: a layer, or the embedding / head this stage holds
        units += [shape.embedding_params(vocab_tp)] if first else []
        units += [shape.head_params(vocab_tp)] if last and not (pp == 1 and shape.tied_embeddings) else []
        estimate = _state_bytes(int(params) - experts, experts, max(units), dp, ep, pc.zero_stage, int(acts),
                                accumulating=micro > 1, compute_bytes=act_bytes, param_bytes=param_bytes)
        estimate.runtime = runtime_bytes
        estimate.recompute = rematerialised
        if trainable_params is not None:  # an adapter: only its parameters have gradients and optimizer state
            share = min(1.0, trainable_params / max(shape.total_params(), 1))
            estimate.gradients, estimate.optimizer = int(estimate.gradients * share), int(estimate.optimizer * share)
        estimate.context = context_buffer_bytes(shape, pc, per_device_batch // micro, seq_length, act_bytes,
                                                kv_exchange)
        if mapped_embedding and first and trainable_params is not None:
            estimate.parameters -= _unread_embedding_bytes(shape, pc, per_device_batch * seq_length // pc.cp, last,
                                                           param_bytes)
        if last and shape.head != "classifier" and not head_fused:
            estimate.logits_gradient = tokens * shape.vocab // vocab_tp * (FP32_BYTES + act_bytes)
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None
    return best


def _head_fusable(pc: ParallelConfig, dp: int, vocab_tp: int, frozen_head: bool) -> bool:
    """Whether the model can fold its head into the loss under ``pc`` (:mod:`~mindformers_py.layers.loss.fused_head`):
    any head but one FSDP2 shards as a unit of its own (ZeRO-2/3 over several data-parallel ranks), which is fused
    only frozen (gathered for the loss alone; trained, its hooks would not run) and not sharded over the vocabulary
    besides."""
    if dp == 1 or pc.data_parallel_engine != FSDP:
        return True
    return frozen_head and vocab_tp == 1


def _unread_embedding_bytes(shape: ModelShape, pc: ParallelConfig, tokens: int, last: bool, param_bytes: int) -> int:
    """Bytes of a file-mapped token embedding that a step never reads: the table less the rows ``tokens`` look
    up (one page of a row each at most). Nothing when the table is read into memory: ZeRO-3 shards it (FSDP2 copies
    its shard) or tensor parallelism makes it a DTensor (its local part is read out of the file: a Llama 1B LoRA run
    under tp2 measured 2.33 GiB a rank, with the shard resident); nor when the head on this stage is the same table."""
    if (pc.zero_stage >= 3 and pc.dp * pc.cp > 1) or pc.tp > 1 or (last and shape.tied_embeddings):
        return 0
    return max(shape.vocab - tokens, 0) * shape.hidden * param_bytes  # the whole table: no tensor parallelism here


def _head_activation_bytes(shape: ModelShape, tokens: int, vocab_tp: int, act_bytes: int, fused: bool = False,
                           head_ranks: int = 1, norm_sharded: bool = False) -> int:
    """What the last stage keeps for the head: the final norm (its output is the head's input), BERT's dense +
    norm transform, and the fp32 log-softmax over the vocabulary; with the head ``fused`` into the loss, one chunk
    of fp32 logits and the hidden states' gradient instead (:mod:`~mindformers_py.layers.loss.linear_cross_entropy`).
    A fused head split by rows over ``head_ranks`` data-parallel ranks scores every one of those ranks' tokens: their
    hidden states and those states' gradient, gathered, and a chunk of its rows' columns. ``norm_sharded``: the final
    norm runs on DTensors (sequence parallelism)."""
    norm = _norm_kept(shape, norm_sharded) * shape.hidden * tokens * act_bytes if shape.final_norm else 0
    if shape.head == "classifier":
        return norm
    if fused:  # (a vocabulary-parallel rank's chunk spans its own columns)
        columns, rows = shape.vocab // (vocab_tp * head_ranks), tokens * head_ranks
        chunk = min(rows, max(1, CHUNK_ELEMENTS // columns))
        gathered = (2 * rows if head_ranks > 1 else rows) * shape.hidden * act_bytes
        return norm + chunk * columns * FP32_BYTES + gathered
    transform = 4 * shape.hidden * tokens * act_bytes if shape.head == "mlm" else 0
    return norm + transform + tokens * shape.vocab // vocab_tp * FP32_BYTES


def _state_bytes(params: int, expert_params: int, unit_params: int, dp: int, ep: int, zero: int,
                 activations: int, accumulating: bool = False, compute_bytes: int = FP32_BYTES,
                 param_bytes: int = FP32_BYTES) -> MemoryEstimate:
    """Parameters, gradients and AdamW state of ``params`` fp32 parameters sharded by ZeRO ``zero`` over ``dp``
    ranks, and of ``expert_params`` (already split over ``ep``) sharded over the ``dp / ep`` ranks holding the same
    experts. ``accumulating``: gradients of several micro-batches are summed before they are reduced (pipeline
    schedules); ``compute_bytes`` is the size of the parameters gathered for compute; ``unit_params`` the largest
    unit ZeRO-3 gathers at once."""
    dense = _zero_state(params, unit_params, dp, zero, accumulating, compute_bytes, param_bytes)
    if not expert_params:
        return MemoryEstimate(*dense, activations)
    expert = _zero_state(expert_params, 0, max(dp // ep, 1), zero, accumulating, compute_bytes, param_bytes)
    return MemoryEstimate(*(a + b for a, b in zip(dense, expert)), activations)


def _zero_state(params: int, unit_params: int, dp: int, zero: int, accumulating: bool = False,
                compute_bytes: int = FP32_BYTES, param_bytes: int = FP32_BYTES) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of ``params`` under ZeRO ``zero`` over ``dp`` ranks; the parameters
    are held in ``param_bytes`` each (a frozen base loaded in bf16: 2), gradients in fp32; ZeRO-3 gathers units of
    up to ``unit_params``."""
    full, grad_full = params * param_bytes, params * FP32_BYTES
    if dp == 1 or zero == 0:
        return full, grad_full, params * ADAM_STATE_BYTES
    optimizer = params * ADAM_STATE_BYTES // dp
    if zero == 1:
        return full, grad_full, optimizer
    # Under a pipeline schedule torch.distributed.pipelining turns FSDP's gradient reduction off until the last
    # micro-batch (set_requires_gradient_sync(False)): gradients accumulate whole beside their shards, and ZeRO-3
    # keeps the parameters it gathered for backward (set_reshard_after_backward(False)).
    grads = grad_full + grad_full // dp if accumulating else grad_full // dp
    if zero == 2:  # sharded storage + whole parameters kept from forward through backward
        return full + full // dp, grads, optimizer
    # zero 3: shards + the largest unit gathered: its all-gather buffer and the parameter copied out of it (or the
    # running unit and the prefetched one), in the dtype it is gathered in (mixed precision casts before gathering)
    gathered = params * compute_bytes if accumulating else 2 * unit_params * min(param_bytes, compute_bytes)
    return full // dp + gathered, grads, optimizer
