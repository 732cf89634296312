"""What context parallelism costs and saves, for the planner's memory and time models.

Each of ``cp = ring x ulysses`` ranks holds ``seq / cp`` tokens of every sequence (:mod:`mindformers_py.parallel.
context`), so everything per token (projections, MLP, norms, the head, the activations kept for backward, the
hidden states a pipeline stage sends) is divided by ``cp``. Attention still relates every query to every key:

* **work**: a rank attends its ``seq / ring`` queries (of its ``heads / (tp x ulysses)`` heads) to all ``seq`` keys;
  under a causal mask the load-balanced layout gives every rank half of that, as a single device skips half of
  the whole. The work per rank is the single device's divided by ``cp``.
* **ring traffic**: ``ring - 1`` times per layer and forward pass, a rank sends its key/value block (``2 x
  kv_width / tp`` values per local token) to the next rank, while it computes attention with the block it holds:
  a transfer is exposed only where it takes longer than that block's share of the attention compute. Backward
  sends the blocks around again, with their gradients (fp32) travelling back after each block's compute, which
  this implementation waits for. Runtimes that all-gather the keys and values of the whole sequence instead
  (Llama 3, torchtitan's default rotation) move the same volume in one collective before attention, not overlapped
  (:attr:`~.step_time.Runtime.context_kv`).
* **Ulysses traffic**: two all-to-alls per layer and pass (queries, keys and values to head shards; the output
  back), each moving ``(ulysses - 1) / ulysses`` of the rank's tensors; they block the attention that needs them.
* **memory**: the activations of ``seq / cp`` tokens, plus the blocks in flight for one layer at a time (two
  key/value blocks and their fp32 gradients for the ring; the whole sequence's keys and values when all-gathered).

Context-parallel ranks are ``tp`` ranks apart (``ulysses x tp`` for the ring of the hybrid algorithm) in the rank
order pp, dp, cp, tp, so a group fits a node while ``cp x tp`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.config import ParallelConfig
from .collectives import all_to_all_seconds, group_bandwidth, ring_seconds
from .device_spec import DeviceSpec
from .model_shape import ModelShape

FP32_BYTES = 4


@dataclass(frozen=True)
class AttentionGeometry:
    """One rank's share of a layer's attention for one micro-batch."""

    batch_heads: float
    """Independent heads it computes: micro-batch x heads / (tp x ulysses)."""
    q_len: int
    """Queries of each head: ``seq / ring``."""
    kv_len: int
    """Keys each query may see: the whole sequence."""
    causal_half: bool
    """A causal mask hides half of the work (load-balanced over the ring)."""


def attention_geometry(shape: ModelShape, pc: ParallelConfig, batch: int, seq: int, causal: bool) -> AttentionGeometry:
    """The attention one rank computes under ``pc`` (a single device's when ``cp`` is 1)."""
    return AttentionGeometry(batch * shape.heads / (pc.tp * pc.cp_ulysses), seq // pc.cp_ring, seq, causal)


def kv_block_bytes(shape: ModelShape, pc: ParallelConfig, batch: int, seq: int, act_bytes: int) -> float:
    """Bytes of one rank's keys and values of one layer for one micro-batch (its ring share, its heads)."""
    kv_width = shape.kv_width if shape.kv_heads % pc.cp_ulysses == 0 or pc.cp_ulysses == 1 else shape.q_width
    return batch * (seq / pc.cp_ring) * 2 * kv_width / (pc.tp * pc.cp_ulysses) * act_bytes


def context_forward_backward_seconds(shape: ModelShape, pc: ParallelConfig, batch: int, seq: int, device: DeviceSpec,
                                     act_bytes: int, core_forward: float, core_backward: float,
                                     kv_exchange: str = "ring") -> tuple[float, float]:
    """Exposed seconds of one self-attention layer's context-parallel traffic for one micro-batch: (forward,
    backward). ``core_forward``/``core_backward`` are the rank's attention compute, behind which the ring's
    transfers run; ``kv_exchange`` is ``"ring"`` (point-to-point, overlapped) or ``"allgather"``."""
    if pc.cp == 1:
        return 0.0, 0.0
    forward = backward = 0.0
    ring, ulysses, tp = pc.cp_ring, pc.cp_ulysses, pc.tp
    if ring > 1:
        stride = tp * ulysses
        block = kv_block_bytes(shape, pc, batch, seq, act_bytes)
        gradient = block / act_bytes * FP32_BYTES
        bandwidth = group_bandwidth(ring, stride, device)
        hop = block / bandwidth + device.link_latency_s
        grad_hop = gradient / bandwidth + device.link_latency_s
        if kv_exchange == "allgather":
            forward += (ring - 1) * hop
            backward += (ring - 1) * (hop + grad_hop)  # all-gather again, reduce-scatter the gradients
        else:
            forward += (ring - 1) * max(0.0, hop - core_forward / ring)
            backward += (ring - 1) * max(0.0, hop - core_backward / ring) + ring * grad_hop
    if ulysses > 1:
        local = batch * seq / pc.cp  # tokens a rank holds before the exchange
        kv_width = shape.kv_width if shape.kv_heads % ulysses == 0 else shape.q_width
        inputs = local * (shape.q_width + 2 * kv_width) / tp * act_bytes
        output = local * shape.q_width / tp * act_bytes
        exchange = all_to_all_seconds(inputs, ulysses, tp, device) + all_to_all_seconds(output, ulysses, tp, device)
        forward += exchange
        backward += exchange
    return forward, backward


def cross_attention_gather_seconds(shape: ModelShape, pc: ParallelConfig, batch: int, seq: int, device: DeviceSpec,
                                   act_bytes: int) -> tuple[float, float]:
    """An encoder-decoder's cross-attention under context parallelism: the encoder's keys and values of every rank
    are all-gathered in forward and their gradients reduced back in backward."""
    if pc.cp == 1:
        return 0.0, 0.0
    whole = batch * seq * 2 * shape.kv_width / pc.tp * act_bytes
    gather = ring_seconds(whole, pc.cp, pc.tp, device, all_reduce=False)
    return gather, gather


def context_buffer_bytes(shape: ModelShape, pc: ParallelConfig, batch: int, seq: int, act_bytes: int,
                         kv_exchange: str = "ring") -> int:
    """Bytes one layer's context-parallel attention holds beside the saved activations while it runs: two
    key/value blocks in flight and their fp32 gradients (ring), or the whole sequence's keys and values and their
    gradients (all-gather)."""
    if pc.cp == 1 or pc.cp_ring == 1:
        return 0
    block = kv_block_bytes(shape, pc, batch, seq, act_bytes)
    blocks = pc.cp_ring if kv_exchange == "allgather" else 2
    return int(blocks * block * (1 + FP32_BYTES / act_bytes))
