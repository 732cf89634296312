"""Mixture of experts: a router sends each token to k of E expert MLPs, whose outputs are mixed by the router's
probabilities (Switch Transformer, GShard, Mixtral, Qwen-MoE), optionally beside shared experts every token uses.

Expert compute groups tokens by expert, never loops over tokens: the (token, choice) assignments are sorted by
expert (a stable sort, so first choices come before second choices and earlier tokens before later ones, as GShard
orders them), the tokens are gathered in that order, each expert runs its matrix products on its contiguous rows
(:class:`GroupedExperts`: a grouped matrix product, one slice per expert, over stacked expert weights), and each
token sums its k results back, weighted. Nothing is padded: ``routing_policy="dropless"`` computes exactly the
``k`` rows of every token; ``"topk"`` keeps at most ``capacity`` rows per expert (Switch Transformer) and drops the
rest of that expert's queue (those assignments add nothing; the residual carries the token).

Expert parallelism needs nothing from this file: ``mindformers_py.parallel`` shards the stacked expert weights
and wraps :class:`GroupedExperts` with an all-to-all before and after it (rows grouped by expert travel to the
rank holding the expert, with the per-expert counts). Layers compute with local sizes, so an expert-parallel rank
simply sees fewer experts.

Router losses are computed where the loss is, from per-sequence statistics each MoE layer returns
(:func:`router_statistics`, columns laid out by :func:`stat_columns`): top-k counts, summed probabilities, routed
tokens, summed squared log-sum-exp and dropped assignments per expert and sequence. They are small and add up over
layers and sequences, so a pipeline stage hands them to the next (the loss sits on the last one), and both the
load-balancing loss over all layers at once (transformers' ``load_balancing_loss_func``) and a sequence-wise one
come out of them exactly (:func:`router_losses`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ...errors import check_choice
from ..mlp import _TANH_GELU, MLP
from .config import MoEConfig, moe_config_of
from .gate_up_product import gate_up_product
from .router import Router
from .sigmoid_router import GroupLimitedSigmoidRouter

ROUTERS: dict[str, type[Router]] = {"softmax_topk": Router, "deepseek_v3": GroupLimitedSigmoidRouter}
"""``MoEConfig.router_type`` -> the router class an MoE layer builds (:attr:`~MoEConfig.router_type`'s choices)."""


FUSED_GATE_UP_ROWS = 32
"""Rows per local expert (on average) from which the gate and up projections run as one grouped product over their
weights side by side: the copy costs as much as moving both weights once, which a few rows per expert (a decode step:
k rows in all) do not pay back, while hundreds per expert (a training batch) run faster fused."""


def stat_width(num_experts: int) -> int:
    """Columns of one layer's router statistics: counts and probability sums per expert, then routed tokens,
    summed squared log-sum-exp and dropped assignments."""
    return 2 * num_experts + 3


def stat_columns(num_experts: int) -> dict[str, slice | int]:
    """Where each statistic sits in a row of :func:`router_statistics`."""
    e = num_experts
    return {"counts": slice(0, e), "probs": slice(e, 2 * e), "tokens": 2 * e, "z": 2 * e + 1, "dropped": 2 * e + 2}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a sharded (DTensor) weight, or the tensor itself: layers compute with local sizes."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _grouped_mm_runs(tokens: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` has a kernel for these tensors: on CPU from torch 2.11 (2.10's
    wants 16-byte aligned storage), on CUDA for bf16 on compute capability 8.0 and up."""
    if not hasattr(F, "grouped_mm"):
        return False
    if tokens.device.type == "cpu":
        # Under torch.compile the op is traced by its meta function, which (torch 2.13) accepts only bf16 inputs,
        # though the CPU kernel takes fp32 too: compiled fp32 code (a compiled decode step, torch_compile) loops.
        traceable = not torch.compiler.is_compiling() or tokens.dtype == weight.dtype == torch.bfloat16
        return _TORCH_VERSION >= (2, 11) and traceable
    if tokens.device.type == "cuda":
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(tokens.device) >= (8, 0)
    return False


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _aligned(sizes: torch.Size, dtype: torch.dtype) -> bool:
    """Whether rows of these sizes (an expert's intermediate and hidden widths) are multiples of 16 bytes in
    ``dtype``, which ``grouped_mm``'s kernels require of every stride (torch 2.13 raises otherwise: e.g. 12-wide
    experts in bf16, where the per-expert products run instead)."""
    return all(n * dtype.itemsize % 16 == 0 for n in sizes)


def _activation(act: str):
    check_choice("hidden_act", act, sorted(ACT2FN.keys()))
    return functools.partial(F.gelu, approximate="tanh") if act in _TANH_GELU else ACT2FN[act]


class _PaddedGroups:
    """Each expert's rows padded with zero rows to a multiple of a granularity, so the per-expert products on the
    CPU see a few shapes again and again.

    torch's CPU ``grouped_mm`` runs one matrix product per expert, and oneDNN builds a kernel for every new shape:
    with a row count that changes every step (routing moves), a bf16 product cost ~3 ms instead of 0.2 ms (measured
    on the benchmark machine: ``[M, 256] @ [256, 768]``, M varying vs fixed), which made bf16 MoE training slower
    than fp32. Rounding each expert's rows up to a multiple of ``granularity`` (64 rows for a training batch, less
    for small batches so decoding does not multiply its work) bounds the shapes at the cost of a few percent more
    rows; the zero rows contribute nothing to outputs or gradients. fp32 products (MKL, no per-shape kernels) lose
    less to new shapes than the padding costs, so only bf16 is padded.
    """

    MIN_GRANULARITY = 8  # below it (a few rows per expert: decoding) the shapes are few anyway

    @classmethod
    def of(cls, counts: torch.Tensor, num_rows: int) -> _PaddedGroups | None:
        """The padding for ``num_rows`` rows split by ``counts``, or None where it would not pay."""
        per_expert = max(1, num_rows // (8 * counts.shape[0]))
        granularity = min(64, 1 << (per_expert.bit_length() - 1))
        return cls(counts, num_rows, granularity) if granularity >= cls.MIN_GRANULARITY else None

    def __init__(self, counts: torch.Tensor, num_rows: int, granularity: int) -> None:
        experts, g = counts.shape[0], granularity
        self.granularity = granularity
        self.padded_counts = (counts + g - 1) // g * g
        starts = counts.cumsum(0) - counts
        padded_starts = self.padded_counts.cumsum(0) - self.padded_counts
        expert_of_row = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts)
        # where each row lands in the padded layout
        self.index = torch.arange(num_rows, device=counts.device) + (padded_starts - starts)[expert_of_row]
        self.padded_rows = int(self.padded_counts.sum())

    def pad(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.new_zeros(self.padded_rows, tokens.shape[1]).index_copy(0, self.index, tokens)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        return out.index_select(0, self.index)


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs as stacked weights, run on rows grouped by expert: ``forward(tokens, counts)``.

    ``gate_proj`` and ``up_proj`` (E, I, H) (``gate_proj`` only when gated: SwiGLU), ``down_proj`` (E, H, I): each
    expert's ``nn.Linear`` weights stacked. Experts have no biases. Tensor parallelism splits the ``I`` dimension of
    all three (each rank then returns a partial sum), expert parallelism the ``E`` dimension; either way the code
    below runs on the local part.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu",
                 gated: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gated = gated
        if gated:
            self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = _activation(act)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` (R, H), the rows of expert 0 first, then expert 1's, ...; ``counts`` (E_local,) how many each
        expert has -> (R, H): every row through its expert, as grouped matrix products (``F.grouped_mm`` where
        torch has the kernel, else one product per expert over its contiguous rows)."""
        weights = [_local(self.up_proj), _local(self.down_proj)] + ([_local(self.gate_proj)] if self.gated else [])
        dtype = torch.get_autocast_dtype(tokens.device.type) if torch.is_autocast_enabled(tokens.device.type) \
            else weights[0].dtype  # grouped_mm is not autocast-aware: cast as autocast would
        # Fewer rows than experts (decoding) loop over the experts that have rows: a grouped product visits all.
        if tokens.shape[0] >= counts.shape[0] and _grouped_mm_runs(tokens, weights[0]) \
                and _aligned(weights[0].shape[1:], dtype):
            rows = _PaddedGroups.of(counts, tokens.shape[0]) if tokens.device.type == "cpu" and dtype == torch.bfloat16 \
                else None
            if rows is not None:
                tokens, counts = rows.pad(tokens), rows.padded_counts
            offsets = counts.cumsum(0).to(torch.int32)
            if self.gated and tokens.shape[0] >= FUSED_GATE_UP_ROWS * counts.shape[0]:
                # gate and up in one product (see gate_up_product: its weight copy is not kept for backward)
                gate, up = gate_up_product(tokens, weights[2], weights[0], offsets, dtype).chunk(2, dim=-1)
            else:  # few rows per expert (decoding, many small experts): copying the weights would cost more
                x = tokens.to(dtype)
                up = F.grouped_mm(x, weights[0].to(dtype).transpose(-2, -1), offs=offsets)
                gate = F.grouped_mm(x, weights[2].to(dtype).transpose(-2, -1), offs=offsets) if self.gated else None
            h = self.act(gate) * up if self.gated else self.act(up)
            out = F.grouped_mm(h, weights[1].to(dtype).transpose(-2, -1), offs=offsets)
            return out if rows is None else rows.unpad(out)
        # One product per expert; the stacked weights are split once, so backward stacks their gradients once.
        ups, downs = weights[0].unbind(0), weights[1].unbind(0)
        gates = weights[2].unbind(0) if self.gated else ups
        out = []
        for rows, up_w, gate_w, down_w in zip(tokens.split(counts.tolist()), ups, gates, downs):
            if not rows.shape[0] and tokens.shape[0]:  # nothing to add (unbind's backward fills its gradient with 0)
                continue
            up = rows @ up_w.t()
            h = self.act(rows @ gate_w.t()) * up if self.gated else self.act(up)
            out.append(h @ down_w.t())
        return torch.cat(out)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward block, used in place of :class:`~mindformers_py.layers.mlp.MLP`.

    Submodules follow transformers' names: ``gate`` (the :class:`Router`), ``experts`` (:class:`GroupedExperts`),
    ``shared_expert`` (an :class:`MLP`) and ``shared_expert_gate``. ``forward(x, token_mask)`` returns the output and
    this layer's router statistics per sequence (:func:`router_statistics`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, moe: MoEConfig, act: str = "silu",
                 gated: bool = True) -> None:
        super().__init__()
        self.num_experts = moe.expert_num
        self.top_k = moe.num_experts_chosen
        self.capacity_factor = None if moe.routing_policy == "dropless" else moe.capacity_factor
        self.gate = ROUTERS[moe.router_type].from_config(hidden_size, moe)
        self.experts = GroupedExperts(moe.expert_num, hidden_size, moe.expert_size(intermediate_size), act, gated)
        shared = moe.shared_expert_size(intermediate_size)
        self.shared_expert = MLP(hidden_size, shared, act, gated, bias=False) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.use_shared_expert_gating else None
        self.jitter_noise = moe.router_jitter_noise

    @classmethod
    def from_config(cls, config: Any) -> MoE:
        """The MoE block of a model config with the common field names (``hidden_size``, ``intermediate_size``,
        ``hidden_act``, ``gated_mlp``) and a ``moe_config`` section."""
        return cls(config.hidden_size, config.intermediate_size, moe_config_of(config), config.hidden_act,
                   bool(config.gated_mlp))

    def forward(self, hidden_states: torch.Tensor,
                token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states`` (B, T, H) -> (output (B, T, H), router statistics (B, :func:`stat_width`)).
        ``token_mask`` (B, T), 1 for real tokens, keeps padding out of the statistics (not out of the routing)."""
        b, t, h = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative input noise, training only
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.reshape(-1, h)  # (N, H)
        logits = self.gate(x)  # (N, E)
        probs, weights, chosen = self.gate.select(logits)
        if self.training:
            self.gate.observe(chosen, token_mask)
        out, dropped = self._route(x, weights, chosen)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        stats = router_statistics(logits, probs, chosen, dropped, token_mask, b, self.gate.scores_are_softmax)
        return out.view(b, t, h), stats

    def capacity(self, num_tokens: int) -> int | None:
        """Rows one expert takes from ``num_tokens`` tokens: the Switch capacity with token dropping, None for
        dropless routing."""
        if self.capacity_factor is None:
            return None
        return max(math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts), 1)

    def _route(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch tokens to their experts, run the experts, combine; returns the output (N, H) and the dropped
        assignments per token (N,)."""
        n, k = chosen.shape
        flat = chosen.t().reshape(-1)  # (k·N,) all first choices, then all second choices, ...
        order = torch.argsort(flat, stable=True)  # grouped by expert; within one, by choice rank then token
        counts = torch.bincount(flat, minlength=self.num_experts)
        token, choice = order % n, order // n
        dropped = x.new_zeros(n, dtype=torch.float32)
        capacity = self.capacity(n)
        if capacity is not None and capacity < int(counts.max()):
            position = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts)[flat[order]]
            keep = position < capacity  # each expert's queue, cut at its capacity
            dropped = dropped.index_add(0, token[~keep], torch.ones_like(token[~keep], dtype=torch.float32))
            token, choice, counts = token[keep], choice[keep], counts.clamp(max=capacity)
        # index_select, not x[token]: the same rows, but its backward is an index_add, where indexing's is an
        # accumulating index_put that the CPU runs 5x slower (4.0 against 0.8 ms a layer in the Qwen3-MoE benchmark)
        done = self.experts(x.index_select(0, token), counts)  # (rows, H), grouped by expert
        mixed = (done.float() * weights[token, choice].unsqueeze(-1)).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, token, mixed), dropped


def router_statistics(logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, dropped: torch.Tensor,
                      token_mask: torch.Tensor | None, batch: int, softmax: bool = True) -> torch.Tensor:
    """Per-sequence statistics of one MoE layer, (B, :func:`stat_width`) in float32 (see :func:`stat_columns`):
    how many top-k choices went to each expert, the summed router probabilities of each expert (the only part
    with a gradient, with the log-sum-exp's), routed tokens, summed squared log-sum-exp of the logits and dropped
    assignments, all over the tokens ``token_mask`` (B, T) keeps. ``softmax``: ``probs`` are the logits' softmax
    (else the log-sum-exp is computed from the logits)."""
    n, e = probs.shape
    t, k = n // batch, chosen.shape[-1]
    mask = torch.ones(batch, t, device=probs.device) if token_mask is None \
        else token_mask.reshape(batch, t).to(device=probs.device, dtype=torch.float32)
    rows = torch.arange(batch, device=probs.device).repeat_interleave(t * k)  # the sequence of each choice
    counts = torch.bincount(rows * e + chosen.reshape(-1), weights=mask.repeat_interleave(k, dim=1).reshape(-1),
                            minlength=batch * e).view(batch, e).float()
    prob_sums = (probs.view(batch, t, e) * mask.unsqueeze(-1)).sum(1)
    if softmax:  # log-sum-exp from the softmax already taken: lse = top logit - log(top probability), at least 1/E
        top = chosen[:, :1]
        lse = logits.float().gather(1, top).squeeze(1) - probs.gather(1, top).squeeze(1).log()
    else:
        lse = torch.logsumexp(logits.float(), dim=-1)
    z = (lse.view(batch, t).square() * mask).sum(1)
    drops = (dropped.view(batch, t) * mask).sum(1)
    return torch.cat([counts, prob_sums, mask.sum(1, keepdim=True), z.unsqueeze(1), drops.unsqueeze(1)], dim=1)


def router_losses(stats: torch.Tensor, num_experts: int, scope: str = "batch", row_weights: torch.Tensor | None = None,
                  num_items_in_batch: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The load-balancing loss and the z-loss from router statistics (B, layers, :func:`stat_width`).

    ``scope="batch"``: transformers' ``load_balancing_loss_func`` exactly, ``E · Σ_e f_e · P_e`` with ``f_e`` the
    share of top-k choices and ``P_e`` the mean probability of expert ``e`` over all tokens of all MoE layers at
    once (so layers that favour different experts can look balanced together). ``"sequence"``: DeepSeek-V3's
    sequence-wise balance loss (its paper's eqs. 17-20, as DeepSeek-V2's), per MoE layer and sequence of ``T``
    tokens ``Σ_e f_e · P_e`` with ``f_e = E / (k · T) · count_e`` and ``P_e`` the mean of ``probs`` (for the
    sigmoid router the scores normalised per token, the paper's ``s'``), averaged over the layers, then over the
    sequences; it is 1 for a balanced layer (the batch formula, without the ``1/k``, is ``k``). The z-loss is the mean
    over routed tokens (and layers) of the squared log-sum-exp of the router logits.

    ``row_weights`` (B,) are the loss items of each sequence and ``num_items_in_batch`` those of the whole step:
    then each loss is this batch's share of the step's (a sequence-weighted mean, times the batch's share of the
    items for ``"batch"``), so the shares of a step's micro-batches add up over accumulation, data-parallel ranks
    and pipeline micro-batches. Without them they are this forward's own values.
    """
    cols = stat_columns(num_experts)
    counts, probs = stats[..., cols["counts"]], stats[..., cols["probs"]]
    tokens, z_sums = stats[..., cols["tokens"]], stats[..., cols["z"]]
    if scope == "batch":
        routed = tokens.sum().clamp(min=1.0)
        aux = num_experts * ((counts.sum((0, 1)) / routed) * (probs.sum((0, 1)) / routed)).sum()
        z = z_sums.sum() / routed
        if row_weights is not None and num_items_in_batch is not None:
            share = row_weights.sum() / _as_tensor(num_items_in_batch, stats)
            aux, z = aux * share, z * share
        return aux, z
    routed = tokens.clamp(min=1.0).unsqueeze(-1)  # (B, layers, 1)
    choices = counts.sum(-1, keepdim=True).clamp(min=1.0)  # k · T: f_e = E · count_e / (k · T)
    per_layer = num_experts * ((counts / choices) * (probs / routed)).sum(-1)  # (B, layers); 0 for dense layers
    aux_rows = per_layer.sum(1) / (tokens > 0).sum(1).clamp(min=1)  # mean over the layers that routed the row
    z_rows = z_sums.sum(1) / tokens.sum(1).clamp(min=1.0)
    if row_weights is None:
        return aux_rows.mean(), z_rows.mean()
    weights = row_weights.to(stats.dtype)
    total = _as_tensor(num_items_in_batch, stats) if num_items_in_batch is not None else weights.sum().clamp(min=1.0)
    return (aux_rows * weights).sum() / total, (z_rows * weights).sum() / total


def _as_tensor(value: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, device=like.device, dtype=like.dtype)


class RouterMetrics:
    """Running sums of a model's router statistics between two logs of the Trainer (the model's
    ``training_metrics`` hook): per-layer expert loads, dropped assignments and the router losses of the training
    forward passes. :meth:`pop` hands the raw sums over (the engine adds them up over the ranks that saw different
    data), :meth:`summarize` turns the totals into logged values."""

    postfix_keys = ("aux_loss", "load_imbalance")
    """Values worth a place in the progress bar beside the loss."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, moe_layers: list[int], capacity_limited: bool,
                 z_loss: bool) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_layers = list(moe_layers)
        self.capacity_limited = capacity_limited
        self.z_loss = z_loss
        self._sums: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, stats: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        """Count one training forward pass: its statistics (B, layers, width) and router-loss shares."""
        new = {"router_stats": stats.detach().sum(0).double(), "aux_loss": aux.detach().double(),
               "z_loss": z.detach().double()}
        for key, value in new.items():
            self._sums[key] = self._sums[key] + value if key in self._sums else value

    def pop(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The sums since the last call (zeros of the same shapes when nothing ran here, e.g. on a pipeline stage
        without the loss), on ``device``; resets them."""
        zeros = {"router_stats": torch.zeros(self.num_layers, stat_width(self.num_experts), dtype=torch.float64),
                 "aux_loss": torch.zeros((), dtype=torch.float64), "z_loss": torch.zeros((), dtype=torch.float64)}
        out = {key: self._sums.get(key, zero).to(device) for key, zero in zeros.items()}
        self._sums = {}
        return out

    def summarize(self, sums: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
        """Logged values from the totals of ``steps`` optimizer steps: the router losses per step, the load
        imbalance (largest over mean expert load, averaged over MoE layers; 1 is perfect balance) and each layer's
        own (``load_imbalance/layer_<i>``: its most loaded expert against its mean, as MindFormers and Megatron
        show it), each expert's share of the assignments and, with capacity limits, the share of dropped
        assignments, overall and per layer (``dropped_tokens/layer_<i>``)."""
        cols = stat_columns(self.num_experts)
        stats = sums["router_stats"][self.moe_layers]  # (moe layers, width)
        counts = stats[:, cols["counts"]]
        if not counts.any():  # nothing counted (a pipeline without the router loss carries no statistics): no zeros
            return {}
        mean_load = counts.mean(-1).clamp(min=1e-12)
        logs = {"aux_loss": float(sums["aux_loss"]) / max(steps, 1)}
        if self.z_loss:
            logs["z_loss"] = float(sums["z_loss"]) / max(steps, 1)
        per_layer = counts.max(-1).values / mean_load  # (moe layers,)
        logs["load_imbalance"] = float(per_layer.mean())
        if self.capacity_limited:
            assignments = stats[:, cols["tokens"]] * self.top_k
            logs["dropped_tokens"] = float(stats[:, cols["dropped"]].sum() / assignments.sum().clamp(min=1))
        load = counts.sum(0) / counts.sum().clamp(min=1e-12)
        logs.update({f"expert_load/{i}": float(v) for i, v in enumerate(load)})
        logs.update({f"load_imbalance/layer_{i}": float(v) for i, v in zip(self.moe_layers, per_layer)})
        if self.capacity_limited:
            dropped = stats[:, cols["dropped"]] / assignments.clamp(min=1)
            logs.update({f"dropped_tokens/layer_{i}": float(v) for i, v in zip(self.moe_layers, dropped)})
        return logs

