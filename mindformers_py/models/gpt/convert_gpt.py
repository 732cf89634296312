"""HF <-> mindformers_py conversion for the GPT family: GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3 checkpoints (DeepSeek-V3's own fields and names: ``convert_deepseek``).

Our module names follow Llama's, so Llama-like checkpoints map almost one to one; GPT-2's fused, transposed
``Conv1D`` q/k/v projection is split into ``q_proj``/``k_proj``/``v_proj`` (and fused back on export). MoE
checkpoints keep one tensor per expert (Mixtral's ``block_sparse_moe.experts.{j}.w1/w2/w3``, Qwen2-MoE's and
Qwen3-MoE's ``mlp.experts.{j}.gate_proj/up_proj/down_proj``): they are stacked into our experts' ``gate_proj`` /
``up_proj`` / ``down_proj``
and split again on export, which writes the per-expert layout transformers itself saves. Checkpoints that
transformers 5 saved with ``save_original_format=False`` (already stacked) load too.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import ConfigError, MindFormersError
from ..hf_config import carry_general_fields
from . import convert_deepseek as deepseek
from .configuration_gpt import GPTConfig

SUPPORTED_HF_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
MOE_HF_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_HF_TYPES = ("qwen3", "qwen3_moe")  # per-head q/k RMSNorms; attention_bias covers o_proj too
# Config fields copied as-is between our config and Llama-like HF configs.
_LLAMA_LIKE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "rope_parameters", "attention_dropout",
)
_SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# GPT-2's attention options (same names on both sides) and their defaults; the other architectures have none.
_GPT2_ATTENTION_OPTIONS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                           "reorder_and_upcast_attn": False}
# GPT-2's multiple-choice head (GPT2DoubleHeadsModel) settings, same names on both sides, and their defaults.
_GPT2_SUMMARY = {"summary_type": "cls_index", "summary_use_proj": True, "summary_proj_to_labels": True,
                 "summary_activation": None, "summary_first_dropout": 0.1}


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Our :class:`GPTConfig` for an HF ``config.json`` dict of a supported architecture."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_HF_TYPES:
        raise ConfigError(f"model_type={kind!r} is not a supported HF architecture for the GPT family; supported: {', '.join(SUPPORTED_HF_TYPES)}")
    return carry_general_fields(hf, _config_from_hf(hf, kind))


def _config_from_hf(hf: dict[str, Any], kind: str) -> GPTConfig:
    if kind == "gpt2":
        n_embd = hf.get("n_embd", 768)
        return GPTConfig(
            flavour="gpt2", hf_architecture="gpt2", vocab_size=hf.get("vocab_size", 50257), hidden_size=n_embd,
            num_hidden_layers=hf.get("n_layer", 12), num_attention_heads=hf.get("n_head", 12),
            intermediate_size=hf.get("n_inner") or 4 * n_embd, max_position_embeddings=hf.get("n_positions", 1024),
            hidden_act=hf.get("activation_function", "gelu_new"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            embedding_dropout=hf.get("embd_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
            hidden_dropout=hf.get("resid_pdrop", 0.1), initializer_range=hf.get("initializer_range", 0.02),
            tie_word_embeddings=hf.get("tie_word_embeddings", True), add_cross_attention=bool(hf.get("add_cross_attention")),
            **{k: hf.get(k, default) for k, default in {**_GPT2_ATTENTION_OPTIONS, **_GPT2_SUMMARY}.items()},
            **{k: hf.get(k) for k in _SPECIAL_TOKEN_FIELDS},
        )
    kwargs = {k: hf[k] for k in _LLAMA_LIKE_FIELDS if hf.get(k) is not None}
    kwargs["norm_eps"] = hf.get("rms_norm_eps", 1e-6)
    kwargs["hidden_act"] = hf.get("hidden_act", "silu")
    if kwargs.get("rope_parameters") is None:  # configs written before transformers 5
        rope = dict(hf.get("rope_scaling") or {"rope_type": "default"})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = hf.get("rope_theta", 10000.0)
        kwargs["rope_parameters"] = rope
    if kind in QK_NORM_HF_TYPES:
        kwargs["qk_norm"] = True
        kwargs["attention_bias"] = kwargs["attention_out_bias"] = hf.get("attention_bias", False)
    if kind in MOE_HF_TYPES:
        return _moe_config_from_hf(hf, kind, kwargs)
    if kind == "deepseek_v3":  # latent attention; experts (when some layer routes) behind DeepSeek-V3's router
        kwargs.pop("head_dim", None)  # transformers' is the rotary width, which ours derives
        kwargs.update(deepseek.latent_fields_from_hf(hf))
        moe = deepseek.moe_from_hf(hf, kwargs.get("num_hidden_layers", 61))
        return GPTConfig(flavour="llama", hf_architecture=kind, moe_config=moe,
                         output_router_logits=bool(hf.get("output_router_logits", False)), **kwargs)
    if kind == "llama":
        kwargs["attention_bias"] = kwargs["attention_out_bias"] = hf.get("attention_bias", False)
        kwargs["mlp_bias"] = hf.get("mlp_bias", False)
    elif kind == "qwen2":
        kwargs["attention_bias"] = True
        # transformers' rule when config.json has no layer_types: layers from max_window_layers on slide
        kwargs.update(_windowed_layers(hf, lambda i: i >= hf.get("max_window_layers", 28)))
    elif kind == "qwen3":  # the same rule as Qwen2's
        kwargs.update(_windowed_layers(hf, lambda i: i >= hf.get("max_window_layers", 28)))
    else:  # mistral
        kwargs["sliding_window"] = hf.get("sliding_window")
    return GPTConfig(flavour="llama", hf_architecture=kind, **kwargs)


def _windowed_layers(hf: dict[str, Any], slides) -> dict[str, Any]:
    """Qwen2's and Qwen2-MoE's sliding window: ``sliding_window`` and ``layer_types`` (each layer's attention) from
    ``use_sliding_window`` and ``config.json``'s ``layer_types``, else from the architecture's rule ``slides(i)``."""
    if not hf.get("use_sliding_window"):
        return {}
    layers = hf.get("num_hidden_layers", 32)
    types = hf.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention" for i in range(layers)]
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": hf.get("sliding_window"), "layer_types": list(types)}


def _moe_config_from_hf(hf: dict[str, Any], kind: str, kwargs: dict[str, Any]) -> GPTConfig:
    """Mixtral, Qwen2-MoE and Qwen3-MoE: a Llama-like model whose layers route to experts (transformers routes
    dropless, in the hidden states' dtype, and adds the router loss only with ``output_router_logits``)."""
    moe: dict[str, Any] = dict(routing_policy="dropless", router_dense_type="auto", aux_loss_scope="batch",
                               num_experts_chosen=hf.get("num_experts_per_tok", 2),
                               aux_loss_factor=hf.get("router_aux_loss_coef", 0.001))
    if kind == "mixtral":
        moe.update(expert_num=hf.get("num_local_experts", 8), norm_topk_prob=True,
                   router_jitter_noise=hf.get("router_jitter_noise") or 0.0)
        kwargs["sliding_window"] = hf.get("sliding_window")
    elif kind == "qwen3_moe":  # experts of their own size, no shared expert, every layer sliding or none
        kwargs["sliding_window"] = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        # transformers 5 writes the expert count as num_local_experts (an alias of num_experts); the hub's as num_experts
        moe.update(expert_num=hf.get("num_experts", hf.get("num_local_experts", 128)), norm_topk_prob=hf.get("norm_topk_prob", False),
                   moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                   mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                   decoder_sparse_step=hf.get("decoder_sparse_step", 1))
    else:  # qwen2_moe: experts of their own size, a gated shared expert, some layers possibly dense
        # transformers' rule when config.json has no layer_types: every other layer below max_window_layers slides
        kwargs.update(_windowed_layers(hf, lambda i: bool((i + 1) % 2) and i < hf.get("max_window_layers", 28)))
        moe.update(expert_num=hf.get("num_experts", 60), norm_topk_prob=hf.get("norm_topk_prob", False),
                   moe_intermediate_size=hf.get("moe_intermediate_size", 1408), shared_expert_num=1,
                   shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 5632),
                   use_shared_expert_gating=True, mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                   decoder_sparse_step=hf.get("decoder_sparse_step", 1))
        kwargs["attention_bias"] = hf.get("qkv_bias", True)
    return GPTConfig(flavour="llama", hf_architecture=kind, moe_config=moe,
                     output_router_logits=bool(hf.get("output_router_logits", False)), **kwargs)


def hf_type_for(config: GPTConfig) -> str:
    """The HF architecture a config exports to: where it came from, else the closest one by its features."""
    if config.hf_architecture:
        return config.hf_architecture
    if config.attention_type == "mla":
        return "deepseek_v3"
    if config.moe is not None:
        if config.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if config.moe.shared_expert_num else "mixtral"
    if config.flavour == "gpt2":
        return "gpt2"
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias and not config.attention_out_bias:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def config_to_hf(config: GPTConfig):
    """A transformers config object (``GPT2Config``, ``LlamaConfig``, ...) equivalent to ``config``."""
    kind = hf_type_for(config)
    _check_exportable(config, kind)
    return carry_general_fields(config, _config_to_hf(config, kind))


def _config_to_hf(config: GPTConfig, kind: str):
    import transformers

    tokens = {k: getattr(config, k) for k in _SPECIAL_TOKEN_FIELDS}
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
            n_head=config.num_attention_heads, n_inner=config.intermediate_size, n_positions=config.max_position_embeddings,
            activation_function=config.hidden_act, layer_norm_epsilon=config.norm_eps, embd_pdrop=config.embedding_dropout,
            attn_pdrop=config.attention_dropout, resid_pdrop=config.hidden_dropout, initializer_range=config.initializer_range,
            tie_word_embeddings=config.tie_word_embeddings, add_cross_attention=config.add_cross_attention, **tokens,
            **{k: getattr(config, k) for k in (*_GPT2_ATTENTION_OPTIONS, *_GPT2_SUMMARY)},
        )
    kwargs = {k: getattr(config, k) for k in _LLAMA_LIKE_FIELDS}
    kwargs.update(rms_norm_eps=config.norm_eps, hidden_act=config.hidden_act)
    if kind == "llama":
        return transformers.LlamaConfig(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, **kwargs)
    if kind == "qwen2":
        kwargs.pop("head_dim")
        return transformers.Qwen2Config(**kwargs, **_hf_window(config))
    if kind == "deepseek_v3":
        kwargs.pop("head_dim")  # DeepseekV3Config sets it to the rotary width
        return transformers.DeepseekV3Config(**kwargs, **deepseek.config_to_hf_kwargs(config))
    if kind == "qwen3":
        return transformers.Qwen3Config(attention_bias=config.attention_bias, **kwargs, **_hf_window(config))
    if kind in MOE_HF_TYPES:
        moe = config.moe
        kwargs.update(num_experts_per_tok=moe.num_experts_chosen, router_aux_loss_coef=moe.aux_loss_factor,
                      output_router_logits=config.output_router_logits)
        if kind == "qwen3_moe":
            window = config.sliding_window
            return transformers.Qwen3MoeConfig(
                num_experts=moe.expert_num, norm_topk_prob=moe.norm_topk_prob, attention_bias=config.attention_bias,
                moe_intermediate_size=moe.expert_size(config.intermediate_size),
                decoder_sparse_step=moe.decoder_sparse_step, mlp_only_layers=list(moe.mlp_only_layers),
                use_sliding_window=window is not None, **({"sliding_window": window} if window else {}), **kwargs)
        if kind == "mixtral":  # its only MLPs are the experts, sized by intermediate_size
            kwargs["intermediate_size"] = moe.expert_size(config.intermediate_size)
            return transformers.MixtralConfig(sliding_window=config.sliding_window, num_local_experts=moe.expert_num,
                                              router_jitter_noise=moe.router_jitter_noise, **kwargs)
        kwargs.pop("head_dim")
        return transformers.Qwen2MoeConfig(
            num_experts=moe.expert_num, norm_topk_prob=moe.norm_topk_prob, qkv_bias=config.attention_bias,
            moe_intermediate_size=moe.expert_size(config.intermediate_size), decoder_sparse_step=moe.decoder_sparse_step,
            shared_expert_intermediate_size=moe.shared_expert_size(config.intermediate_size),
            mlp_only_layers=list(moe.mlp_only_layers), **kwargs, **_hf_window(config))
    return transformers.MistralConfig(sliding_window=config.sliding_window, **kwargs)


def _hf_window(config: GPTConfig) -> dict[str, Any]:
    """Qwen2's, Qwen3's and Qwen2-MoE's sliding-window fields for ``config``'s layers. ``max_window_layers`` is the
    first sliding layer when the layers from it on all slide (Qwen2's and Qwen3's own rule, so their configs
    come back as they were), else the layer count (``layer_types`` then says which slide)."""
    kinds = config.attention_kinds()
    if "sliding_attention" not in kinds:
        return {"use_sliding_window": False}
    first = kinds.index("sliding_attention")
    rule = all(kind == "sliding_attention" for kind in kinds[first:])
    return {"use_sliding_window": True, "sliding_window": config.sliding_window, "layer_types": kinds,
            "max_window_layers": first if rule else config.num_hidden_layers}


def _check_exportable(config: GPTConfig, kind: str) -> None:
    """Refuse exports the target HF class could not represent (rather than writing a silently different model)."""
    if kind == "deepseek_v3":
        deepseek.check_exportable(config)
        return
    if config.attention_type != "mha":
        raise MindFormersError(f"cannot export to HF {kind}: it needs attention_type='mha', the model has "
                               f"{config.attention_type!r}; export as deepseek_v3")
    wanted = {
        "gpt2": dict(position_embedding_type="learned", norm_type="layernorm", gated_mlp=False, attention_bias=True,
                     attention_out_bias=True, mlp_bias=True, norm_bias=True, sliding_window=None,
                     num_key_value_heads=config.num_attention_heads, head_dim=config.hidden_size // config.num_attention_heads),
        "llama": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True, attention_out_bias=config.attention_bias, sliding_window=None),
        "mistral": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True, attention_bias=False, attention_out_bias=False, mlp_bias=False),
        "qwen2": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True, attention_bias=True, attention_out_bias=False,
                      mlp_bias=False, head_dim=config.hidden_size // config.num_attention_heads),
        "mixtral": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True, attention_bias=False,
                        attention_out_bias=False, mlp_bias=False),
        "qwen2_moe": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True, attention_out_bias=False,
                          mlp_bias=False, head_dim=config.hidden_size // config.num_attention_heads),
        "qwen3": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True,
                      attention_out_bias=config.attention_bias, mlp_bias=False),
        "qwen3_moe": dict(position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True,
                          attention_out_bias=config.attention_bias, mlp_bias=False),
    }[kind]
    if kind != "gpt2":
        wanted.update(_GPT2_ATTENTION_OPTIONS)
    wanted["qk_norm"] = kind in QK_NORM_HF_TYPES
    if kind not in ("qwen2", "qwen3", "qwen2_moe") and len(set(config.attention_kinds())) > 1:
        raise MindFormersError(f"cannot export to HF {kind}: its layers all attend alike, the model mixes "
                               "sliding_attention and full_attention layers (layer_types); export as qwen2, qwen3 or "
                               "qwen2_moe")
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise MindFormersError(f"cannot export to HF {kind}: it needs {field}={value!r}, the model has {getattr(config, field)!r}")
    moe = config.moe
    if (kind in MOE_HF_TYPES) != (moe is not None):
        raise MindFormersError(f"cannot export to HF {kind}: the model has {'no ' if moe is None else ''}experts "
                               f"(moe_config.expert_num={moe.expert_num if moe else 1})")
    if moe is None:
        return
    if moe.routing_policy != "dropless":
        raise MindFormersError(f"cannot export to HF {kind}: transformers never drops tokens, so it needs "
                               f"moe_config.routing_policy='dropless', the model has {moe.routing_policy!r}")
    if kind == "qwen3_moe":
        for field, value in dict(shared_expert_num=0, router_jitter_noise=0.0).items():
            if getattr(moe, field) != value:
                raise MindFormersError(f"cannot export to HF qwen3_moe: it needs moe_config.{field}={value!r}, the "
                                       f"model has {getattr(moe, field)!r}")
        return
    if kind == "qwen2_moe":
        if moe.router_jitter_noise:
            raise MindFormersError("cannot export to HF qwen2_moe: it has no router jitter, the model has "
                                   f"moe_config.router_jitter_noise={moe.router_jitter_noise}; export as mixtral or set it to 0")
        if not moe.shared_expert_num or not moe.use_shared_expert_gating:
            raise MindFormersError("cannot export to HF qwen2_moe: it needs a gated shared expert (moe_config."
                                   "shared_expert_num >= 1, use_shared_expert_gating=true)")
        return
    wanted_moe = dict(norm_topk_prob=True, shared_expert_num=0, mlp_only_layers=(), decoder_sparse_step=1)  # all routed
    for field, value in wanted_moe.items():
        if getattr(moe, field) != value:
            raise MindFormersError(f"cannot export to HF {kind}: it needs moe_config.{field}={value!r}, the model has "
                                   f"{getattr(moe, field)!r}")


# --------------------------------------------------------------------------- weights
_GPT2_RENAMES = [  # (HF GPT-2 pattern, ours); {i} is the layer index
    ("wte.weight", "model.embed_tokens.weight"),
    ("wpe.weight", "model.embed_positions.weight"),
    ("ln_f.{p}", "model.norm.{p}"),
    ("h.{i}.ln_1.{p}", "model.layers.{i}.input_layernorm.{p}"),
    ("h.{i}.ln_2.{p}", "model.layers.{i}.post_attention_layernorm.{p}"),
    ("h.{i}.attn.c_proj.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("h.{i}.mlp.c_fc.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
    ("h.{i}.mlp.c_proj.{p}", "model.layers.{i}.mlp.down_proj.{p}"),
    ("h.{i}.ln_cross_attn.{p}", "model.layers.{i}.cross_attn_layernorm.{p}"),
    ("h.{i}.crossattention.q_attn.{p}", "model.layers.{i}.cross_attn.q_proj.{p}"),
    ("h.{i}.crossattention.c_proj.{p}", "model.layers.{i}.cross_attn.o_proj.{p}"),
]
# GPT-2's Conv1D layers store weights as (in, out); nn.Linear wants (out, in).
_CONV1D = (".c_proj.", ".c_fc.", ".q_attn.")


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


_GPT2_TO_OURS = [(_regex(h), o) for h, o in _GPT2_RENAMES]
_OURS_TO_GPT2 = [(_regex(o), h) for h, o in _GPT2_RENAMES]


def _rename(key: str, rules) -> str | None:
    for regex, target in rules:
        m = regex.match(key)
        if m:
            return target.format(**m.groupdict())
    return None


# Head modules (ours) that sit beside the base model; HF GPT-2's token classifier is named "classifier".
_HEADS = ("lm_head.", "score.", "qa_outputs.", "multiple_choice_head.")
_HF_HEAD_RENAMES = {"classifier.": "score."}
# HF question-answering classes that keep their base model under "transformer." (transformers' old name).
_TRANSFORMER_PREFIX_QA = ("gpt2", "llama", "qwen2", "qwen3", "qwen3_moe")


def _our_head_key(key: str) -> str | None:
    """``key`` as our head's parameter name when it belongs to a head, else None."""
    for hf, ours in _HF_HEAD_RENAMES.items():
        if key.startswith(hf):
            return ours + key[len(hf):]
    return key if key.startswith(_HEADS) else None


# One HF tensor per expert: (layer, expert, part) -> where it goes in our stacked weights. Mixtral's w1/w3/w2 and
# Qwen2-MoE's gate_proj/up_proj/down_proj are the gate, up and down projections.
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*layers\.(?P<i>\d+))\.(?:block_sparse_moe|mlp)\.experts\.(?P<j>\d+)\."
                         r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_QWEN_EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_HF_EXPERT_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}, "qwen2_moe": _QWEN_EXPERT_NAMES,
                    "qwen3_moe": _QWEN_EXPERT_NAMES, "deepseek_v3": _QWEN_EXPERT_NAMES}
_EXPERT_HF_TYPES = (*MOE_HF_TYPES, "deepseek_v3")  # checkpoints with one tensor per expert


def _stack_experts(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_state`` with per-expert tensors stacked into our ``mlp.experts.{gate,up,down}_proj`` (E, out, in), a
    stacked ``gate_up_proj`` (transformers 5's own layout, gate rows above up rows) split in two, and Mixtral's
    ``block_sparse_moe`` renamed ``mlp``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in hf_state.items():
        m = _EXPERT_KEY.match(key)
        if m:
            parts = experts.setdefault(m["prefix"], {})
            parts.setdefault(_EXPERT_PARTS[m["part"]], {})[int(m["j"])] = value
        elif key.endswith(".experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            stem = key.removesuffix("gate_up_proj").replace(".block_sparse_moe.", ".mlp.")
            out[stem + "gate_proj"], out[stem + "up_proj"] = gate.contiguous(), up.contiguous()
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = value
    for prefix, parts in experts.items():
        for part, tensors in parts.items():
            out[f"{prefix}.mlp.experts.{part}_proj"] = torch.stack([tensors[j] for j in range(len(tensors))])
    return out


def _split_experts(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Our stacked expert weights as one tensor per expert under ``kind``'s names (what transformers saves)."""
    names = _HF_EXPERT_NAMES[kind]
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = re.match(r"^(.*layers\.\d+)\.mlp\.(experts\.(gate|up|down)_proj|gate\.weight)$", key)
        if m is None:
            out[key] = value
        elif m[2] == "gate.weight":
            out[f"{m[1]}.{block}.gate.weight"] = value
        else:
            for j, tensor in enumerate(value.unbind(0)):
                out[f"{m[1]}.{block}.experts.{j}.{names[m[3]]}.weight"] = tensor.contiguous()
    return out


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Map an HF state dict of ``config.hf_architecture`` (any of its heads) to our parameter names (and layouts)."""
    if hf_type_for(config) in _EXPERT_HF_TYPES:
        hf_state = _stack_experts(hf_state)
    if hf_type_for(config) == "deepseek_v3":
        hf_state = deepseek.mtp_from_hf(deepseek.rename_from_hf(hf_state), config)
    if hf_type_for(config) != "gpt2":
        out = {}
        for key, value in hf_state.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # a buffer we recompute, stored by some old checkpoints
            head = _our_head_key(key)
            if head is not None:
                out[head] = value
            elif key.startswith("mtp."):  # DeepSeek-V3's multi-token prediction, beside the base model
                out[key] = value
            else:  # the base model, under "model.", "transformer." (some QA classes) or no prefix (base classes)
                out["model." + key.split(".", 1)[1] if key.startswith(("model.", "transformer.")) else f"model.{key}"] = value
        return out
    out = {}
    for key, value in hf_state.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias", ".crossattention.bias", ".crossattention.masked_bias")):
            continue  # causal-mask buffers of old GPT-2 checkpoints
        head = _our_head_key(key)
        if head is not None:
            out[head] = value
            continue
        m = re.match(r"^h\.(\d+)\.(attn|crossattention)\.c_attn\.(weight|bias)$", key)
        if m:  # fused q, k, v (self-attention) or k, v (cross-attention, whose queries are q_attn)
            i, where, p = m.groups()
            names, attn = (("q_proj", "k_proj", "v_proj"), "self_attn") if where == "attn" else (("k_proj", "v_proj"), "cross_attn")
            parts = value.t().chunk(len(names), dim=0) if p == "weight" else value.chunk(len(names))
            for name, part in zip(names, parts):
                out[f"model.layers.{i}.{attn}.{name}.{p}"] = part.contiguous()
            continue
        new = _rename(key, _GPT2_TO_OURS)
        if new is None:
            raise MindFormersError(f"unexpected tensor {key!r} in the gpt2 checkpoint")
        out[new] = value.t().contiguous() if key.endswith(".weight") and any(c in key for c in _CONV1D) else value
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], config: GPTConfig, task: str | None = None) -> dict[str, torch.Tensor]:
    """Map our state dict (of the ``task`` head, a registry task name) to the HF architecture's names and layouts
    (tied weights written once)."""
    tied = config.tie_word_embeddings
    kind = hf_type_for(config)
    heads = {k: v for k, v in state.items() if k.startswith(_HEADS) and not (tied and k == "lm_head.weight")}
    if kind == "gpt2" and task == "token_classification":
        heads = {"classifier." + k.split(".", 1)[1]: v for k, v in heads.items()}
    body = {k: v for k, v in state.items() if not k.startswith(_HEADS)}
    if kind == "deepseek_v3":  # the MTP layers after the decoder layers (the head's weight copied into them)
        body = deepseek.mtp_to_hf({**body, **{k: v for k, v in state.items() if k == "lm_head.weight"}}, config)
        body.pop("lm_head.weight", None)
    if kind in _EXPERT_HF_TYPES:
        body = _split_experts(body, kind)
    if kind == "deepseek_v3":
        body = deepseek.rename_to_hf(body)
    if kind != "gpt2":
        if task == "question_answering" and kind in _TRANSFORMER_PREFIX_QA:
            body = {"transformer." + k.split(".", 1)[1]: v for k, v in body.items()}
        return {**body, **heads}
    out: dict[str, torch.Tensor] = dict(heads)
    fused: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for key, value in body.items():
        m = re.match(r"^model\.layers\.(\d+)\.(self_attn\.[qkv]|cross_attn\.[kv])_proj\.(weight|bias)$", key)
        if m:
            i, which, p = m.groups()
            attn, part = which.split(".")
            fused.setdefault((i, "attn" if attn == "self_attn" else "crossattention", p), {})[part] = value
            continue
        new = _rename(key, _OURS_TO_GPT2)
        if new is None:
            raise MindFormersError(f"tensor {key!r} has no place in a gpt2 checkpoint")
        conv = new.endswith(".weight") and any(c in new for c in _CONV1D)
        out[f"transformer.{new}"] = value.t().contiguous() if conv else value
    for (i, where, p), parts in fused.items():
        joined = torch.cat([parts[n] for n in "qkv" if n in parts], dim=0)
        out[f"transformer.h.{i}.{where}.c_attn.{p}"] = joined.t().contiguous() if p == "weight" else joined
    return out
