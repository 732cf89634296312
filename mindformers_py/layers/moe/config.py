"""Mixture-of-experts settings: :class:`MoEConfig` (MindFormers' ``moe_config``), the one description of an MoE
layer. A model config holds it as its ``moe_config`` section; :class:`~mindformers_py.layers.moe.layer.MoE` is built
from it; ``mindformers_py.parallel`` reads it to split the experts over expert-parallel ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, invalid_choice
from ...utils.config_section import _require_int, _Section, _split_list, _to_bool, _to_choice, _to_float, _to_int

ROUTING_POLICIES = ("topk", "dropless")
# MindFormers' router class names; both route tokens top-k with a per-expert capacity.
ROUTING_POLICY_ALIASES = {"topkrouterv1": "topk", "topkrouterv2": "topk"}
AUX_LOSS_SCOPES = ("batch", "sequence")
ROUTER_DTYPES = ("float32", "bfloat16", "float16", "auto")
ROUTER_TYPES = ("softmax_topk", "deepseek_v3")
"""Router kinds (:data:`mindformers_py.layers.moe.layer.ROUTERS` builds each): how a token's expert scores are computed
and its experts chosen."""


@dataclass
class MoEConfig(_Section):
    """Mixture-of-experts routing and expert shapes (MindFormers' ``moe_config``); ``expert_num=1`` means a dense
    model."""

    expert_num: int = 1
    """Number of routed experts in each MoE layer (1 = no MoE)."""
    num_experts_chosen: int = 1
    """Experts each token is routed to (top-k); at most ``expert_num``."""
    moe_intermediate_size: int | None = None
    """Hidden size of one routed expert's MLP; None means the model's ``intermediate_size``."""
    capacity_factor: float = 1.1
    """With ``routing_policy="topk"``: each expert takes at most ``ceil(capacity_factor * tokens * k /
    expert_num)`` of the tokens of one forward pass on one rank (Switch Transformer); assignments over capacity are
    dropped (that expert adds nothing for the token; the residual carries it). At least 1."""
    routing_policy: str = "topk"
    """``"topk"``: top-k routing with a per-expert capacity and token dropping (MindFormers' TopkRouterV1/V2, both
    accepted as aliases); ``"dropless"``: every token reaches its k experts (transformers' Mixtral and Qwen-MoE),
    ``capacity_factor`` unused."""
    router_type: str = "softmax_topk"
    """How the router scores and chooses experts: ``"softmax_topk"``, a softmax over the experts' logits and the k
    most probable (Switch Transformer, Mixtral, Qwen-MoE); ``"deepseek_v3"``, sigmoid scores, chosen with a
    per-expert selection bias (``e_score_correction_bias``, see ``bias_update_rate``) among the ``topk_group`` best of
    ``n_group`` expert groups, weighted by the unbiased scores (DeepSeek-V3, transformers' ``DeepseekV3TopkRouter``).
    Each kind is a router class of its own (``mindformers_py.layers.moe.layer.ROUTERS``)."""
    n_group: int = 1
    """``router_type="deepseek_v3"``: the experts form this many equal groups (consecutive indices; it must divide
    ``expert_num``), and each token picks its experts from its ``topk_group`` best groups only, a group scoring the
    sum of its two best biased scores (DeepSeek-V3's node-limited routing: 8 groups of 32). 1: no group limit."""
    topk_group: int = 1
    """``router_type="deepseek_v3"``: how many of the ``n_group`` groups each token may choose experts from (at most
    ``n_group``, and enough groups to hold ``num_experts_chosen`` experts; DeepSeek-V3: 4)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' mixing weights (after ``norm_topk_prob``) before they are added to the shared
    experts' output (DeepSeek-V2/V3's ``routed_scaling_factor``: 2.5 in DeepSeek-V3)."""
    bias_update_rate: float = 0.0
    """``router_type="deepseek_v3"``: auxiliary-loss-free load balancing (DeepSeek-V3 paper, section 2.1.2). After
    every optimizer step each MoE layer moves its selection bias by ``bias_update_rate * sign(mean load - load)``
    per expert, the loads being the tokens that chose each expert in the step's whole global batch (all data,
    context and expert-parallel ranks and accumulated micro-batches). The bias only picks experts, never weighs
    them. 0 (the default) leaves the bias as the checkpoint has it; DeepSeek-V3 trained with 0.001."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' router probabilities to sum to 1 per token (Mixtral, Qwen3-MoE); False keeps
    the raw softmax probabilities (Qwen1.5/2-MoE)."""
    aux_loss_factor: float = 0.05
    """Weight of the load-balancing loss (Switch Transformer, transformers' ``router_aux_loss_coef``) added to the
    training loss when the model's ``output_router_logits`` is on; 0 disables it."""
    aux_loss_scope: str = "batch"
    """Which tokens the load-balancing statistics are taken over: ``"batch"``, all tokens of one forward pass (one
    micro-batch on one rank) and all MoE layers together (transformers' ``load_balancing_loss_func``), or
    ``"sequence"``, each MoE layer and sequence on its own, averaged over the layers and the step's loss items
    (DeepSeek-V3's sequence-wise balance loss, with its paper's ``1/k`` normalisation: 1 when balanced; with
    ``router_type="deepseek_v3"`` its probabilities are the sigmoid scores normalised per token, as in the paper).
    Only ``"sequence"`` is the same whatever the batch is split into (data-parallel ranks, pipeline micro-batches,
    accumulation)."""
    z_loss_factor: float = 0.0
    """Weight of the router z-loss (ST-MoE: the mean squared log-sum-exp of the router logits) added with the
    load-balancing loss; 0 disables it."""
    shared_expert_num: int = 0
    """Shared experts every token passes through besides its routed ones (DeepSeek-MoE, Qwen-MoE), computed as one
    MLP of ``shared_expert_num * moe_intermediate_size`` (or ``shared_expert_intermediate_size``)."""
    shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared-expert MLP when it is not ``shared_expert_num * moe_intermediate_size``
    (Qwen-MoE's ``shared_expert_intermediate_size``)."""
    use_shared_expert_gating: bool = False
    """Scale the shared experts' output by ``sigmoid(x · w)``, a learned per-token gate (Qwen-MoE)."""
    router_dense_type: str = "float32"
    """Dtype of the router's matrix product: ``"float32"`` (MindFormers' default, also under bf16 autocast),
    ``"bfloat16"``, ``"float16"``, or ``"auto"``: the dtype the hidden states arrive in (transformers' routers).
    The softmax over experts always runs in float32."""
    mlp_only_layers: tuple[int, ...] = ()
    """Indices of layers that keep a dense MLP instead of experts (transformers' ``mlp_only_layers``)."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer routes to experts (layers ``step - 1``, ``2·step - 1``, ...; the others are dense),
    as transformers' Qwen-MoE ``decoder_sparse_step``; 1: every layer not in ``mlp_only_layers``."""
    router_jitter_noise: float = 0.0
    """In training, multiply the MoE block's input by noise drawn uniformly from ``[1 - j, 1 + j]`` before routing
    (transformers' Mixtral ``router_jitter_noise``, from Switch Transformer); 0 disables it. Evaluation is never
    jittered."""

    def _convert(self) -> None:
        self.expert_num = _to_int("expert_num", self.expert_num)
        self.num_experts_chosen = _to_int("num_experts_chosen", self.num_experts_chosen)
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                setattr(self, name, _to_int(name, getattr(self, name)))
        self.capacity_factor = _to_float("capacity_factor", self.capacity_factor, 0.0, inclusive=False)
        self.aux_loss_factor = _to_float("aux_loss_factor", self.aux_loss_factor, 0.0, inclusive=True)
        self.z_loss_factor = _to_float("z_loss_factor", self.z_loss_factor, 0.0, inclusive=True)
        self.router_jitter_noise = _to_float("router_jitter_noise", self.router_jitter_noise, 0.0, inclusive=True)
        self.routing_policy = _to_choice("routing_policy", self.routing_policy, ROUTING_POLICIES,
                                         ROUTING_POLICY_ALIASES)
        self.aux_loss_scope = _to_choice("aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        self.norm_topk_prob = _to_bool("norm_topk_prob", self.norm_topk_prob)
        self.shared_expert_num = _to_int("shared_expert_num", self.shared_expert_num, minimum=0)
        self.use_shared_expert_gating = _to_bool("use_shared_expert_gating", self.use_shared_expert_gating)
        self.router_dense_type = _to_choice("router_dense_type", self.router_dense_type, ROUTER_DTYPES)
        self.router_type = _to_choice("router_type", self.router_type, ROUTER_TYPES)
        self.n_group = _to_int("n_group", self.n_group)
        self.topk_group = _to_int("topk_group", self.topk_group)
        self.routed_scaling_factor = _to_float("routed_scaling_factor", self.routed_scaling_factor, 0.0,
                                               inclusive=False)
        self.bias_update_rate = _to_float("bias_update_rate", self.bias_update_rate, 0.0, inclusive=True)
        self.decoder_sparse_step = _to_int("decoder_sparse_step", self.decoder_sparse_step)
        layers = _split_list(self.mlp_only_layers)
        if isinstance(layers, (str, int)):
            layers = [layers]
        if not isinstance(layers, (list, tuple)):
            raise ConfigError(f"mlp_only_layers={self.mlp_only_layers!r} is not valid; expected a list of layer indices")
        self.mlp_only_layers = tuple(sorted({_to_int("mlp_only_layers", i, minimum=0) for i in layers}))

    def validate(self) -> None:
        """Check ranges and the relations between fields; raise a one-line ConfigError naming the field."""
        _require_int("expert_num", self.expert_num)
        _require_int("num_experts_chosen", self.num_experts_chosen)
        _require_int("shared_expert_num", self.shared_expert_num, minimum=0)
        _require_int("decoder_sparse_step", self.decoder_sparse_step)
        _require_int("n_group", self.n_group)
        _require_int("topk_group", self.topk_group)
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name, inclusive in (("capacity_factor", False), ("aux_loss_factor", True), ("z_loss_factor", True),
                                ("router_jitter_noise", True), ("routed_scaling_factor", False),
                                ("bias_update_rate", True)):
            value = getattr(self, name)
            if not isinstance(value, float):  # strings were converted at construction
                raise ConfigError(f"{name}={value!r} is not valid; expected a number {'>=' if inclusive else '>'} 0")
            _to_float(name, value, 0.0, inclusive)
        if self.routing_policy not in ROUTING_POLICIES:
            raise invalid_choice("routing_policy", self.routing_policy, ROUTING_POLICIES)
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise invalid_choice("aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        if self.router_dense_type not in ROUTER_DTYPES:
            raise invalid_choice("router_dense_type", self.router_dense_type, ROUTER_DTYPES)
        if self.router_type not in ROUTER_TYPES:
            raise invalid_choice("router_type", self.router_type, ROUTER_TYPES)
        for name in ("norm_topk_prob", "use_shared_expert_gating"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; expected true or false")
        if self.num_experts_chosen > self.expert_num:
            raise ConfigError(
                f"num_experts_chosen={self.num_experts_chosen} is not valid with expert_num={self.expert_num}; "
                f"choose 1..{self.expert_num}"
            )
        self._validate_groups()
        if self.routing_policy == "topk" and self.capacity_factor < 1:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor} is not valid with routing_policy='topk' (token dropping); "
                "expected capacity_factor >= 1 (below 1 the experts cannot take even a balanced load), or "
                "routing_policy='dropless'"
            )
        if self.shared_expert_num == 0:
            for name in ("shared_expert_intermediate_size", "use_shared_expert_gating"):
                if getattr(self, name):
                    raise ConfigError(f"{name}={getattr(self, name)!r} is not valid with shared_expert_num=0; "
                                      "set shared_expert_num >= 1 to have a shared expert")

    def _validate_groups(self) -> None:
        """Group-limited routing and the selection bias: DeepSeek-V3's router only, groups that split the experts
        evenly and hold the top-k."""
        if self.router_type != "deepseek_v3":
            for name, off in (("n_group", 1), ("topk_group", 1), ("bias_update_rate", 0.0)):
                if getattr(self, name) != off:
                    raise ConfigError(f"{name}={getattr(self, name)!r} is not valid with router_type="
                                      f"{self.router_type!r}; it needs router_type='deepseek_v3' (or {name}={off})")
            return
        if self.expert_num % self.n_group:
            raise ConfigError(f"n_group={self.n_group} is not valid with expert_num={self.expert_num}; expected a "
                              "divisor of expert_num (the experts split into equal groups)")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} is not valid with n_group={self.n_group}; "
                              f"choose 1..{self.n_group}")
        room = self.topk_group * (self.expert_num // self.n_group)
        if self.num_experts_chosen > room:
            raise ConfigError(
                f"num_experts_chosen={self.num_experts_chosen} is not valid with topk_group={self.topk_group} groups "
                f"of {self.expert_num // self.n_group} experts; choose at most {room} (or raise topk_group)")

    @property
    def is_moe(self) -> bool:
        """Whether the model has more than one expert."""
        return self.expert_num > 1

    def routed_layers(self, num_layers: int) -> list[int]:
        """Indices of the layers (of ``num_layers``) whose MLP is a mixture of experts: every
        ``decoder_sparse_step``-th one not in ``mlp_only_layers``."""
        return [i for i in range(num_layers) if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0]

    def expert_capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert accepts from a batch of ``num_tokens`` (None for ``"dropless"``: no limit)."""
        if self.routing_policy == "dropless":
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.num_experts_chosen / self.expert_num)

    def expert_size(self, intermediate_size: int) -> int:
        """Hidden size of one routed expert, given the model's dense ``intermediate_size``."""
        return self.moe_intermediate_size or intermediate_size

    def shared_expert_size(self, intermediate_size: int) -> int:
        """Hidden size of the shared-expert MLP (0 without shared experts)."""
        if self.shared_expert_num == 0:
            return 0
        return self.shared_expert_intermediate_size or self.shared_expert_num * self.expert_size(intermediate_size)


def expert_count(config: Any) -> tuple[int | None, str]:
    """The number of routed experts of any model config and the field it came from: ours (its ``moe_config``
    section) or transformers' (``num_experts``, ``expert_num``, ``num_local_experts``); (None, "") for a dense
    model. The one reader of the expert count."""
    moe = moe_config_of(config)
    if moe is not None:
        return moe.expert_num, "moe_config.expert_num"
    for name in ("num_experts", "expert_num", "num_local_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value, name
    return None, ""


def moe_config_of(config: Any) -> MoEConfig | None:
    """The :class:`MoEConfig` of a model config (its ``moe_config`` section, an instance or a mapping), or None when
    the model has no experts."""
    section = getattr(config, "moe_config", None)
    if section is None:
        return None
    moe = section if isinstance(section, MoEConfig) else MoEConfig.coerce(section, "moe_config")
    return moe if moe.is_moe else None
