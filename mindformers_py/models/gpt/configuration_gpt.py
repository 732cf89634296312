"""GPTConfig: one decoder-only family in two flavours, GPT-2 style and Llama style, chosen by config."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch
from transformers import PretrainedConfig

from ...errors import ConfigError, check_choice
from ...layers.moe.config import MoEConfig, moe_config_of
from ..cache_names import CACHE_NAMES

# Defaults that differ between the flavours. A field left as None takes its flavour's value, so
# `GPTConfig(flavour="llama", attention_bias=True)` is a Qwen2-like model and explicit values always win.
FLAVOURS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        position_embedding_type="learned", norm_type="layernorm", norm_eps=1e-5, norm_bias=True, hidden_act="gelu_new",
        gated_mlp=False, attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True,
        qk_norm=False,
    ),
    "llama": dict(
        position_embedding_type="rope", norm_type="rmsnorm", norm_eps=1e-6, norm_bias=False, hidden_act="silu",
        gated_mlp=True, attention_bias=False, attention_out_bias=False, mlp_bias=False, tie_word_embeddings=False,
        qk_norm=False,
    ),
}
POSITION_EMBEDDING_TYPES = ("learned", "rope")
ATTENTION_TYPES = ("mha", "mla")
# Multi-head latent attention's sizes, each a positive integer (q_lora_rank may be None: one q_proj).
_MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
LAYER_TYPES = ("full_attention", "sliding_attention")

_MINDFORMERS_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                      "n_kv_heads": "num_key_value_heads", "seq_length": "max_position_embeddings",
                      "ffn_hidden_size": "intermediate_size"}
_FLAVOUR_NAMES = {
    "gpt2": {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
             "layer_norm_epsilon": "norm_eps", "activation_function": "hidden_act", "resid_pdrop": "hidden_dropout",
             "embd_pdrop": "embedding_dropout", "attn_pdrop": "attention_dropout"},
    "llama": {"rms_norm_eps": "norm_eps"},
}
_TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    # Qwen3's per-head q/k norms: one weight shared by the heads, whole on every rank, its gradient summed over them.
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.o_proj": "rowwise",
    # Multi-head latent attention: the latent down-projections and their norms whole on every rank (the ranks then
    # compute the same latents), the up-projections split by heads, the rotary key's gradient summed over the ranks.
    "layers.*.self_attn.q_a_proj": "replicated",
    "layers.*.self_attn.q_a_layernorm": "replicated",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "replicated",
    "layers.*.self_attn.kv_a_layernorm": "replicated",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.shared_key": "shared_by_heads",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    # MoE layers: the shared expert shards like an MLP; routed experts are split by expert parallelism instead.
    "layers.*.mlp.shared_expert.gate_proj": "colwise",
    "layers.*.mlp.shared_expert.up_proj": "colwise",
    "layers.*.mlp.shared_expert.down_proj": "rowwise",
}


def _tp_plan_of(config: "GPTConfig") -> dict[str, str]:
    """The entries of the plan whose modules this config's model has: the dense MLP (its gate only when gated)
    when some layer is dense, the shared expert only in MoE layers that have one, the q/k norms with ``qk_norm``."""
    moe = config.moe
    dense = moe is None or len(config.moe_layers()) < config.num_hidden_layers
    shared = moe is not None and moe.shared_expert_num > 0

    mla = config.attention_type == "mla"

    def exists(name: str) -> bool:
        if name.endswith(("q_norm", "k_norm")):
            return bool(config.qk_norm)
        if name.endswith(("q_a_proj", "q_a_layernorm", "q_b_proj")):
            return mla and config.q_lora_rank is not None
        if name.endswith(("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "shared_key")):
            return mla
        if name.endswith(("k_proj", "v_proj")):
            return not mla
        if name.endswith("self_attn.q_proj"):
            return not mla or config.q_lora_rank is None
        if ".mlp.shared_expert." in name:
            return shared
        if ".mlp." in name:
            return dense and (config.gated_mlp or not name.endswith("gate_proj"))
        return True

    return {name: style for name, style in _TP_PLAN.items() if exists(name)}


class _ByFlavour:
    """A class attribute whose value depends on the config it is read from: read from the class, ``default``; read
    from a config, ``of(config)`` (a function), or the ``default`` combined with ``of[config.flavour]`` (a table of
    dicts, with ``combine``). Never stored in the instance, so never saved in ``config.json``."""

    def __init__(self, default: dict, of, combine: bool = False) -> None:
        self.default, self.of, self.combine = default, of, combine
        self.tables = {key: {**default, **extra} for key, extra in of.items()} if combine else {}
        self.every = {k: v for table in self.tables.values() for k, v in table.items()}

    def __get__(self, config, owner=None):
        if config is None:
            return self.default
        if self.combine:  # read on every attribute access (transformers' alias lookup): no recursion, no copies
            if torch.compiler.is_compiling():  # inside a compiled graph: every flavour's names (no __dict__ peek)
                return self.every
            return self.tables.get(object.__getattribute__(config, "__dict__").get("flavour"), self.default)
        return self.of(config)


class GPTConfig(PretrainedConfig):
    """Configuration of :class:`GPTModel` and its heads (a transformers ``PretrainedConfig``).

    ``GPTConfig(flavour="gpt2", ...)`` gives learned positions, LayerNorm, GELU, biases and tied embeddings;
    ``GPTConfig(flavour="llama", ...)`` gives RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases and an
    untied head. MindFormers-style names (``num_layers``, ``num_heads``, ``seq_length``, ...) are accepted as
    aliases of the HF names. A ``moe_config`` section with ``expert_num > 1`` makes it a mixture-of-experts model
    (GPT-MoE; transformers' Mixtral, Qwen2-MoE and Qwen3-MoE shapes). ``qk_norm=True`` on the Llama flavour is
    Qwen3's attention (per-head RMSNorms of the queries and keys before RoPE).
    """

    model_type = "mindformers_gpt"
    keys_to_ignore_at_inference = [*CACHE_NAMES]
    # Not remote code: our classes are registered with transformers' Auto classes on import. Tools that resolve a
    # non-transformers architecture through ``config.auto_map`` (trl) then fall back to those Auto classes.
    auto_map: ClassVar[Mapping[str, str]] = MappingProxyType({})
    # Other names of the fields: MindFormers' for every flavour, and each flavour's transformers names (a GPT-2
    # flavoured config answers ``n_layer``, ``n_embd``, ... as transformers' ``GPT2Config`` does).
    attribute_map = _ByFlavour(_MINDFORMERS_NAMES, _FLAVOUR_NAMES, combine=True)
    # How tensor parallelism shards each layer (HF's plan vocabulary, applied by mindformers_py.parallel). Read from
    # a config, it names only the modules that model has (see _tp_plan_of); read from the class, every entry.
    base_model_tp_plan = _ByFlavour(_TP_PLAN, _tp_plan_of)
    # How pipeline parallelism cuts the base model: module name -> (inputs, outputs).
    base_model_pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "embed_positions": (["position_ids"], ["position_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    flavour: str = "gpt2"
    """Architecture preset filling the fields left as None: ``"gpt2"`` or ``"llama"``."""
    vocab_size: int = 50257
    """Number of token ids."""
    hidden_size: int = 768
    """Model width."""
    num_hidden_layers: int = 12
    """Number of transformer layers."""
    num_attention_heads: int = 12
    """Query heads per layer."""
    num_key_value_heads: int | None = None
    """Key/value heads per layer (grouped-query attention); None means one per query head."""
    head_dim: int | None = None
    """Size of one attention head; None means ``hidden_size // num_attention_heads``."""
    intermediate_size: int | None = None
    """MLP hidden size; None means 4·hidden (gpt2) or Llama's rounded 8/3·hidden (llama)."""
    max_position_embeddings: int = 1024
    """Positions the model was built for: the size of the learned position table (GPT-2: the longest input), or
    the rotary context length that rope scaling refers to (Llama: longer inputs run, as in transformers)."""
    position_embedding_type: str | None = None
    """``"learned"`` absolute positions or ``"rope"`` rotary positions."""
    rope_parameters: dict | None = None
    """RoPE settings in transformers' format, e.g. ``{"rope_type": "default", "rope_theta": 10000.0}``."""
    norm_type: str | None = None
    """``"layernorm"`` or ``"rmsnorm"``."""
    norm_eps: float | None = None
    """Epsilon of the norms."""
    norm_bias: bool | None = None
    """Whether LayerNorm has a bias (ignored by RMSNorm)."""
    hidden_act: str | None = None
    """MLP activation (a transformers ACT2FN name: ``gelu_new``, ``gelu``, ``silu``, ...)."""
    gated_mlp: bool | None = None
    """Gated MLP (SwiGLU with ``silu``) instead of the two-layer MLP."""
    attention_bias: bool | None = None
    """Biases on the q/k/v projections (GPT-2, Qwen2)."""
    attention_out_bias: bool | None = None
    """Bias on the attention output projection (GPT-2; Qwen3's ``attention_bias`` sets it with the q/k/v ones)."""
    qk_norm: bool | None = None
    """An RMSNorm over ``head_dim`` (epsilon ``norm_eps``) on each query and key head before the rotary positions
    (Qwen3 and Qwen3-MoE); None takes the flavour's (off)."""
    attention_type: str = "mha"
    """``"mha"``: multi-head (grouped-query) attention with ``q_proj``/``k_proj``/``v_proj``/``o_proj``;
    ``"mla"``: multi-head latent attention (DeepSeek-V2/V3, :class:`~mindformers_py.layers.latent_attention.
    LatentAttention`), sized by the five fields below, whose decode cache keeps ``kv_lora_rank + qk_rope_head_dim``
    values per token and layer. With ``"mla"``, ``head_dim`` is the rotary width ``qk_rope_head_dim`` (transformers'
    rule) and the positions must be ``"rope"``."""
    q_lora_rank: int | None = None
    """MLA: width of the query latent (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``); None: one ``q_proj``."""
    kv_lora_rank: int | None = None
    """MLA: width of the key/value latent ``c_kv`` (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``)."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key width without rotary positions."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head rotary width (one rotary key shared by all heads)."""
    v_head_dim: int | None = None
    """MLA: per-head value width."""
    rope_interleave: bool = True
    """MLA: rotary positions over interleaved pairs of the rotary dimensions (DeepSeek's checkpoints,
    transformers' ``rope_interleave``); False: over halves, as Llama's."""
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction layers of a DeepSeek-V3 checkpoint (its ``num_nextn_predict_layers``, transformers'
    ``num_mtp_layers``), stored after the decoder layers as ``model.layers.<num_hidden_layers + i>.*``. Carried to
    and from HF configs (transformers writes 1 by default, whether or not the weights hold the layer); the causal-LM
    model builds that many :class:`~mindformers_py.layers.multi_token_prediction.MultiTokenPrediction` modules only
    when ``use_mtp`` says so."""
    use_mtp: bool | None = None
    """Build the ``num_nextn_predict_layers`` multi-token-prediction modules on :class:`GPTForCausalLM` (Megatron's
    ``mtp_num_layers``, DeepSeek-V3's MTP) and add their loss to the training loss. None (the default): decided by
    the checkpoint, True when loading an HF ``deepseek_v3`` checkpoint whose file holds the MTP layers'
    tensors (they then load and export back under their names), else False once the model is built --
    transformers' behaviour, whose ``DeepseekV3ForCausalLM`` never builds them. True: build them (randomly initialised where the checkpoint lacks
    them); False: never (a checkpoint's MTP tensors are then reported as not used). The main model's logits are the
    same either way; generation never runs the modules."""
    mtp_loss_weight: float = 0.1
    """Weight ``λ`` of the multi-token-prediction loss added to the main loss when the modules are built and
    ``labels`` are given (DeepSeek-V3's report: 0.3 for its first 10T tokens, then 0.1; Megatron's
    ``mtp_loss_scaling_factor``, 0.1 by default). 0 keeps transformers' loss while the modules still run."""
    mlp_bias: bool | None = None
    """Biases in the MLP projections."""
    tie_word_embeddings: bool | None = None
    """Share the LM head weight with the token embedding."""
    sliding_window: int | None = None
    """Attend only to this many most recent positions (Mistral/Qwen2); None for full attention."""
    layer_types: list[str] | None = None
    """Each layer's attention, ``"full_attention"`` or ``"sliding_attention"`` (transformers' field: Qwen2, Qwen3
    and Qwen2-MoE mix them); None (the default) becomes every layer sliding when ``sliding_window`` is set, else
    every layer full, when the config is made."""
    add_cross_attention: bool = False
    """Every layer of a GPT-2-flavoured model attends, after its self-attention, to an encoder's output: the decoder
    of transformers' ``EncoderDecoderModel`` (BERT-to-GPT-2). A Llama-flavoured model ignores it, as transformers'
    Llama does."""
    scale_attn_weights: bool = True
    """Scale the attention scores by ``head_dim ** -0.5``; False leaves them unscaled (GPT-2's option)."""
    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide layer i's attention scores by i + 1 (GPT-2's option, for stable deep models)."""
    reorder_and_upcast_attn: bool = False
    """Under the eager attention implementation, compute the scores and their softmax in float32 whatever the
    activations' dtype (GPT-2's option, for mixed precision; the SDPA path is unchanged, as in transformers)."""
    embedding_dropout: float = 0.0
    """Dropout after the embeddings."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on each residual branch."""
    classifier_dropout: float | None = None
    """Dropout before the token-classification head; None means ``hidden_dropout``."""
    summary_type: str = "cls_index"
    """How :class:`GPTDoubleHeadsModel`'s multiple-choice head summarises a choice: ``"cls_index"`` (the token at
    ``mc_token_ids``, else the last), ``"last"``, ``"first"`` or ``"mean"`` (transformers' GPT-2 names, all the
    ``summary_*`` fields)."""
    summary_use_proj: bool = True
    """The multiple-choice head projects the summary (to one score, with ``summary_proj_to_labels``)."""
    summary_proj_to_labels: bool = True
    """The projection has ``num_labels`` outputs (one score per choice) instead of ``hidden_size``."""
    summary_activation: str | None = None
    """Activation after the projection (a transformers ACT2FN name), or None."""
    summary_first_dropout: float = 0.1
    """Dropout on the summary before the projection."""
    initializer_range: float = 0.02
    """Std of the normal weight init (output projections are scaled by 1/sqrt(2·layers), as GPT-2/Megatron)."""
    use_cache: bool = True
    """Return a KV cache from forward passes (generation)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s)."""
    pad_token_id: int | None = None
    """Padding token id (used by sequence classification to find the last real token)."""
    moe_config: dict | None = None
    """Mixture of experts (GPT-MoE): the fields of :class:`~mindformers_py.layers.moe.config.MoEConfig`
    (``expert_num``, ``num_experts_chosen``, ``routing_policy``, ``capacity_factor``, ``aux_loss_factor``, shared
    experts, ...); stored validated, as a plain dict. None or ``expert_num=1``: every layer has a dense MLP."""
    output_router_logits: bool = False
    """Return each MoE layer's router logits and the load-balancing ``aux_loss``, and add the router losses
    (``aux_loss_factor`` x load balancing + ``z_loss_factor`` x z-loss) to the training loss (transformers' switch
    of the same name; our MoE presets turn it on)."""
    hf_architecture: str | None = None
    """The HF ``model_type`` this config was converted from (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
    ``mixtral``, ``qwen2_moe``, ``qwen3_moe``); export goes back to it. None means: pick from the features."""

    def __post_init__(self, **kwargs: Any) -> None:
        # MindFormers aliases arrive as extra kwargs; apply them before deriving head_dim & co. from them.
        for alias in [k for k in kwargs if k in self.attribute_map]:
            setattr(self, alias, kwargs.pop(alias))
        check_choice("flavour", self.flavour, FLAVOURS)
        if self.moe_config is not None:
            self.moe_config = MoEConfig.coerce(self.moe_config, "moe_config").to_dict()
            if moe_config_of(self) is not None and self.mlp_bias is None:
                self.mlp_bias = False  # experts have no biases; nor, then, do the dense layers beside them
        for name, value in FLAVOURS[self.flavour].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        check_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        check_choice("attention_type", self.attention_type, ATTENTION_TYPES)
        if self.attention_type == "mla":
            self._check_latent_attention()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                    "set head_dim explicitly or choose divisible sizes"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.intermediate_size is None:
            self.intermediate_size = _default_intermediate_size(self.hidden_size, bool(self.gated_mlp))
        if self.position_embedding_type == "rope":
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(self.rope_parameters or {})}
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        self._check_layer_types()
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers!r} must be an integer >= 0")
        if isinstance(self.mtp_loss_weight, bool) or not isinstance(self.mtp_loss_weight, (int, float)) \
                or self.mtp_loss_weight < 0:
            raise ConfigError(f"mtp_loss_weight={self.mtp_loss_weight!r} must be a number >= 0")
        moe = moe_config_of(self)
        if moe is not None:
            outside = [i for i in moe.mlp_only_layers if i >= self.num_hidden_layers]
            if outside:
                raise ConfigError(f"moe_config.mlp_only_layers={list(moe.mlp_only_layers)} is not valid: layer {outside[0]} "
                                  f"does not exist (num_hidden_layers={self.num_hidden_layers}); use indices 0..{self.num_hidden_layers - 1}")
            if self.mlp_bias:
                raise ConfigError("mlp_bias=True is not valid with experts (moe_config.expert_num > 1): experts have no "
                                  "biases; set mlp_bias=false")
        super().__post_init__(**kwargs)

    def _check_latent_attention(self) -> None:
        """MLA's sizes are set (positive integers), its positions rotary, ``head_dim`` its rotary width."""
        for name in _MLA_SIZES + (("q_lora_rank",) if self.q_lora_rank is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} is not valid with attention_type='mla'; expected a positive integer")
        if self.position_embedding_type != "rope":
            raise ConfigError(f"position_embedding_type={self.position_embedding_type!r} is not valid with "
                              "attention_type='mla'; latent attention needs 'rope'")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} is not valid; rotary dimensions come in pairs, "
                              "use an even width")
        if self.head_dim is not None and self.head_dim != self.qk_rope_head_dim:
            raise ConfigError(f"head_dim={self.head_dim} is not valid with attention_type='mla'; it is the rotary width, "
                              f"qk_rope_head_dim={self.qk_rope_head_dim} (leave head_dim unset)")
        if self.qk_norm:
            raise ConfigError("qk_norm=True is not valid with attention_type='mla'; latent attention has no per-head "
                              "q/k norms (its latents have kv_a_layernorm and q_a_layernorm)")
        self.head_dim = self.qk_rope_head_dim

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            # Always a list, as in transformers' configs that have the field: its generation code reads
            # ``config.layer_types`` (one mask per kind) whenever the attribute exists.
            self.layer_types = self.attention_kinds()
            return
        self.layer_types = list(self.layer_types)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types holds {bad[0]!r}; each entry must be one of: {', '.join(LAYER_TYPES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types names {len(self.layer_types)} layers but num_hidden_layers="
                              f"{self.num_hidden_layers}; give one entry per layer")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set; set "
                              "sliding_window (the window) or make every layer full_attention")

    def attention_kinds(self) -> list[str]:
        """Each layer's attention kind: :attr:`layer_types`, else every layer ``"sliding_attention"`` with a
        ``sliding_window`` and ``"full_attention"`` without."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding_attention" if self.sliding_window else "full_attention"] * self.num_hidden_layers

    @property
    def embedding_padding_idx(self) -> int | None:
        """The token embedding row of ``pad_token_id``, kept at zero and without gradient, in the Llama flavour (as
        transformers builds Llama, Mistral, Qwen2 and their MoE models); None in GPT-2's, whose table has none."""
        return self.pad_token_id if self.flavour == "llama" else None

    @property
    def cross_attends(self) -> bool:
        """Whether the layers have a cross-attention sublayer (``add_cross_attention`` on a GPT-2 flavour)."""
        return bool(self.add_cross_attention) and self.flavour == "gpt2"

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale the attention layers use: None (``head_dim ** -0.5``) or 1.0 without
        ``scale_attn_weights``."""
        return None if self.scale_attn_weights else 1.0

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the positions can number: ``max_position_embeddings`` for learned positions, None
        (no limit) for rotary ones, which transformers computes for any length (rope scaling relies on it)."""
        return self.max_position_embeddings if self.position_embedding_type == "learned" else None

    @property
    def moe(self) -> MoEConfig | None:
        """The mixture-of-experts settings, or None for a dense model."""
        return moe_config_of(self)

    @property
    def builds_mtp(self) -> bool:
        """Whether the causal-LM model holds multi-token-prediction modules (``use_mtp`` and
        ``num_nextn_predict_layers``)."""
        return bool(self.use_mtp) and self.num_nextn_predict_layers > 0

    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts (none for a dense model)."""
        moe = self.moe
        if moe is None:
            return []
        return moe.routed_layers(self.num_hidden_layers)


def _default_intermediate_size(hidden_size: int, gated: bool) -> int:
    if not gated:
        return 4 * hidden_size
    # SwiGLU keeps the parameter count of a 4·h MLP: 2/3 · 4h, rounded up to a multiple of 256 (Llama).
    return 256 * ((int(8 * hidden_size / 3) + 255) // 256)
