"""The router of an MoE layer: :class:`Router`, a linear map to one logit per expert and softmax top-k selection,
the class every router kind (``MoEConfig.router_type``) subclasses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


class Router(nn.Module):
    """Linear router with softmax top-k selection (``router_type="softmax_topk"``).

    ``forward(x)``: ``logits = x · Wᵀ`` with ``W`` of shape (experts, hidden), in ``dense_type`` (see
    :attr:`MoEConfig.router_dense_type`); returns the logits (tokens, experts), which transformers' output recording
    collects as ``router_logits``. :meth:`select` turns them into each token's experts and mixing weights.

    Other router kinds subclass it and override :meth:`select` (and may add parameters or buffers of their own, such
    as a per-expert selection bias); :data:`~mindformers_py.layers.moe.layer.ROUTERS` names them for
    ``MoEConfig.router_type``. What a router returns from :meth:`select` is all the MoE block, its statistics and
    expert parallelism read.
    """

    scores_are_softmax = True
    """Whether :meth:`select`'s ``probs`` are the softmax of the logits (the statistics then read the log-sum-exp
    off them instead of computing it)."""

    def __init__(self, hidden_size: int, num_experts: int, dense_type: str = "float32", top_k: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.dense_type = dense_type
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    @classmethod
    def from_config(cls, hidden_size: int, moe: MoEConfig) -> Router:
        """The router an MoE layer of ``moe``'s settings uses."""
        return cls(hidden_size, moe.expert_num, moe.router_dense_type, moe.num_experts_chosen, moe.norm_topk_prob,
                   moe.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.dense_type == "auto":
            return F.linear(x, self.weight)
        dtype = getattr(torch, self.dense_type)
        with torch.autocast(x.device.type, enabled=False):  # also under bf16 autocast: the router is precise
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs, weights, chosen)`` from the logits (N, E): each expert's probability (N, E) in float32 (what
        the load-balancing statistics average), and each token's k experts (N, k) with their mixing weights (N, k):
        the top-k probabilities, renormalised to sum to 1 with ``norm_topk_prob``."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return probs, weights, chosen

    def observe(self, chosen: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """Called with each training forward's choices (N, k) and token mask: a router that keeps counts of its
        own (the selection bias's loads) adds them up here; this one keeps none."""
