"""DeepSeek-V3's router (``MoEConfig.router_type="deepseek_v3"``): sigmoid scores, group-limited top-k chosen with a
per-expert selection bias, and the counts of chosen experts that auxiliary-loss-free balancing moves the bias by.

Routing is transformers' ``DeepseekV3TopkRouter`` (and so the DeepSeek-V3 paper's equations 12-16):

* ``s = sigmoid(x · Wᵀ)`` per expert, in float32;
* the choice uses ``s + b``, ``b`` the float32 buffer ``e_score_correction_bias`` (the checkpoint's name): the
  experts form ``n_group`` groups of consecutive indices, each scored by the sum of its two best biased scores; a
  token keeps its ``topk_group`` best groups and takes the ``k`` best biased scores among their experts;
* the mixing weights are the *unbiased* ``s`` of the chosen experts, divided by their sum with ``norm_topk_prob``,
  times ``routed_scaling_factor``.

Auxiliary-loss-free balancing (paper section 2.1.2) lives in two halves. Here: in training, each forward adds the
tokens that chose each expert to the integer buffer ``expert_load`` (not saved), and :meth:`update_bias` moves the
bias by ``bias_update_rate · sign(mean load − load)`` and clears the counts. In the trainer: after each optimizer
step, the counts are summed over every rank that saw other tokens for the same layers, and :meth:`update_bias` is
called with the totals on every rank, so the bias stays identical everywhere (``mindformers_py.trainer`` owns the
collective; a layer imports no parallel code).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import MoEConfig
from .router import Router


class GroupLimitedSigmoidRouter(Router):
    """DeepSeek-V3's top-k router: sigmoid scores, ``n_group`` expert groups of which a token uses ``topk_group``,
    a selection bias ``e_score_correction_bias`` (E,) in float32, weights from the unbiased scores.

    :meth:`select` returns ``probs`` as each token's sigmoid scores divided by their sum over the experts (the
    paper's ``s'`` of its sequence-wise balance loss, eq. 19): a distribution per token, so the load-balancing
    statistics and losses of :mod:`.layer` mean for this router what the paper's equations mean, and the logged
    loads are the same counts of chosen experts as for any router.
    """

    scores_are_softmax = False

    def __init__(self, hidden_size: int, num_experts: int, dense_type: str = "float32", top_k: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, bias_update_rate: float = 0.0) -> None:
        super().__init__(hidden_size, num_experts, dense_type, top_k, norm_topk_prob, routed_scaling_factor)
        self.n_group = n_group
        self.topk_group = topk_group
        self.bias_update_rate = bias_update_rate
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        # Tokens that chose each expert in the training forwards since the last update (int64: exact at any batch
        # size, and left alone by a model's cast to bf16). Not saved: a step's counts never outlive the step.
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    @classmethod
    def from_config(cls, hidden_size: int, moe: MoEConfig) -> GroupLimitedSigmoidRouter:
        return cls(hidden_size, moe.expert_num, moe.router_dense_type, moe.num_experts_chosen, moe.norm_topk_prob,
                   moe.routed_scaling_factor, moe.n_group, moe.topk_group, moe.bias_update_rate)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs, weights, chosen)`` from the logits (N, E): the normalised sigmoid scores (N, E), and each
        token's k experts chosen by the biased scores within its best groups (N, k) with the unbiased scores as
        weights (N, k)."""
        scores = torch.sigmoid(logits.float())
        biased = scores + self.e_score_correction_bias.float()  # for the choice only
        if self.topk_group < self.n_group:  # with every group allowed the mask keeps everything
            per_group = scores.shape[-1] // self.n_group
            grouped = biased.view(-1, self.n_group, per_group)
            group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # (N, groups)
            best = group_scores.topk(self.topk_group, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            biased = biased.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
        chosen = biased.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' epsilon
        weights = weights * self.routed_scaling_factor
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, weights, chosen

    @torch.no_grad()
    def observe(self, chosen: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """Add the chosen experts of one training forward to ``expert_load`` (tokens ``token_mask`` marks as
        padding are not counted), when balancing is on. Recompute runs a forward twice; that doubles every count of
        the layer alike, which ``sign(mean - load)`` does not see."""
        if self.bias_update_rate == 0:
            return
        experts = self.expert_load.shape[0]
        flat = chosen.reshape(-1)
        if token_mask is not None:  # padding goes to an extra bin that is dropped
            keep = token_mask.reshape(-1, 1).to(flat.device).bool().expand(-1, chosen.shape[-1]).reshape(-1)
            flat = torch.where(keep, flat, experts)
        self.expert_load += torch.bincount(flat, minlength=experts + 1)[:experts]

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """One auxiliary-loss-free balancing step: ``bias += bias_update_rate · sign(mean(load) − load)`` in float32,
        ``load`` (E,) the tokens per expert of the whole step (the same tensor on every rank, so every rank makes
        the same update); then the counts start again from zero."""
        load = load.to(device=self.e_score_correction_bias.device, dtype=torch.float64)
        step = torch.sign(load.mean() - load).float() * self.bias_update_rate
        self.e_score_correction_bias.copy_(self.e_score_correction_bias.float() + step)
        self.expert_load.zero_()

    def _apply(self, fn: Any, recurse: bool = True) -> GroupLimitedSigmoidRouter:
        # The bias stays float32 when the model is cast (transformers keeps it in float32 too): steps of 0.001 on
        # values near 1 vanish in bf16.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != bias.dtype and moved.is_floating_point() and not bias.is_meta:
            self.e_score_correction_bias = bias.to(moved.device)
        return self
