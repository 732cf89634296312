"""Mixture-of-experts routing settings: :class:`MoEConfig` (MindFormers' ``moe_config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, invalid_choice
from .config_base import _require_int, _Section, _to_bool, _to_choice, _to_float, _to_int

ROUTING_POLICIES = ("topk", "dropless")
# MindFormers' router class names; both route tokens top-k with a per-expert capacity.
ROUTING_POLICY_ALIASES = {"topkrouterv1": "topk", "topkrouterv2": "topk"}


# ---------------------------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MoEConfig(_Section):
    """Mixture-of-experts routing (MindFormers' ``moe_config``); ``expert_num=1`` means a dense model."""

    expert_num: int = 1
    """Number of experts in each MoE layer (1 = no MoE)."""
    num_experts_chosen: int = 1
    """Experts each token is routed to (top-k); at most ``expert_num``."""
    capacity_factor: float = 1.1
    """With ``routing_policy="topk"``: each expert takes at most ``ceil(capacity_factor * tokens * k /
    expert_num)`` tokens per batch; tokens over capacity skip the layer through the residual."""
    aux_loss_factor: float = 0.05
    """Weight of the load-balancing loss (Switch Transformer) added to the training loss; 0 disables it."""
    z_loss_factor: float = 0.0
    """Weight of the router z-loss (ST-MoE) that keeps router logits small; 0 disables it."""
    routing_policy: str = "topk"
    """``"topk"``: top-k routing with a per-expert capacity (fixed shapes, MindFormers' TopkRouterV1/V2, both
    accepted as aliases); ``"dropless"``: every token reaches its k experts, ``capacity_factor`` unused."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' router probabilities to sum to 1 per token (Mixtral, Qwen-MoE)."""

    def _convert(self) -> None:
        self.expert_num = _to_int("expert_num", self.expert_num)
        self.num_experts_chosen = _to_int("num_experts_chosen", self.num_experts_chosen)
        self.capacity_factor = _to_float("capacity_factor", self.capacity_factor, 0.0, inclusive=False)
        self.aux_loss_factor = _to_float("aux_loss_factor", self.aux_loss_factor, 0.0, inclusive=True)
        self.z_loss_factor = _to_float("z_loss_factor", self.z_loss_factor, 0.0, inclusive=True)
        self.routing_policy = _to_choice("routing_policy", self.routing_policy, ROUTING_POLICIES,
                                         ROUTING_POLICY_ALIASES)
        self.norm_topk_prob = _to_bool("norm_topk_prob", self.norm_topk_prob)

    def validate(self) -> None:
        """Check ranges and that top-k does not exceed the number of experts."""
        _require_int("expert_num", self.expert_num)
        _require_int("num_experts_chosen", self.num_experts_chosen)
        for name, inclusive in (("capacity_factor", False), ("aux_loss_factor", True), ("z_loss_factor", True)):
            value = getattr(self, name)
            if not isinstance(value, float):  # strings were converted at construction
                raise ConfigError(f"{name}={value!r} is not valid; expected a number {'>=' if inclusive else '>'} 0")
            _to_float(name, value, 0.0, inclusive)
        if self.routing_policy not in ROUTING_POLICIES:
            raise invalid_choice("routing_policy", self.routing_policy, ROUTING_POLICIES)
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob={self.norm_topk_prob!r} is not valid; expected true or false")
        if self.num_experts_chosen > self.expert_num:
            raise ConfigError(
                f"num_experts_chosen={self.num_experts_chosen} is not valid with expert_num={self.expert_num}; "
                f"choose 1..{self.expert_num}"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the model has more than one expert."""
        return self.expert_num > 1

    def expert_capacity(self, num_tokens: int) -> int | None:
        """Tokens one expert accepts from a batch of ``num_tokens`` (None for ``"dropless"``: no limit)."""
        if self.routing_policy == "dropless":
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.num_experts_chosen / self.expert_num)


def _expert_count(cfg: Any) -> tuple[int | None, str]:
    """The model config's number of experts and the attribute it came from; (None, "") for dense models."""
    for name in ("num_experts", "expert_num", "num_local_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value, name
    moe = getattr(cfg, "moe_config", None)
    value = getattr(moe, "expert_num", None) if moe is not None else None
    if isinstance(value, int) and value > 1:
        return value, "moe_config.expert_num"
    return None, ""
