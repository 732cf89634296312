"""Mixture-of-experts settings as the parallel layout sees them.

:class:`MoEConfig` itself lives with the MoE layer (:mod:`mindformers_py.layers.moe_config`: model configs hold it
and models may not import ``parallel``); it is re-exported here so ``mindformers_py.parallel`` stays its import
path. :func:`_expert_count` reads the number of experts of any model config (ours or transformers').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..layers.moe_config import AUX_LOSS_SCOPES, ROUTER_DTYPES, ROUTING_POLICIES, ROUTING_POLICY_ALIASES, \
    MoEConfig  # noqa: F401


def _expert_count(cfg: Any) -> tuple[int | None, str]:
    """The model config's number of experts and the attribute it came from; (None, "") for dense models."""
    for name in ("num_experts", "expert_num", "num_local_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value, name
    moe = getattr(cfg, "moe_config", None)
    value = moe.get("expert_num") if isinstance(moe, Mapping) else getattr(moe, "expert_num", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return value, "moe_config.expert_num"
    return None, ""
