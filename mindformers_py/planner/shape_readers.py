"""Reading a :class:`~.model_shape.ModelShape` from a model description: our configs (``GPTConfig`` and presets)
and HF ``config.json`` dicts of every architecture the planner covers (decoders, mixtures of experts, encoders,
encoder-decoders, vision encoders).

The readers here know transformers' architectures only. A reader for an HF ``model_type`` is registered with
:func:`register_shape_reader`; model types our own families convert (``gpt2``, ``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``qwen3_moe``, ...) are read through the family's converter, so the planner sees exactly the model we
would build. Our own configs are read as their family says (its registry entry's ``planner_config``: BERT, T5 and
ViT as the HF config they export to), else field by field, GPT-style. Parameter counts are exact for the HF
classes named in each reader (the tests compare them with transformers' models on the meta device).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..errors import ConfigError
from ..models import registry  # the family table (it imports the built-in families on first read)
from .model_shape import ACTIVATION_SAVED_TENSORS, DEFAULT_ACTIVATION_SAVED, ModelShape


ShapeReader = Callable[[Mapping[str, Any]], ModelShape]
SHAPE_READERS: dict[str, ShapeReader] = {}


def register_shape_reader(*model_types: str) -> Callable[[ShapeReader], ShapeReader]:
    """Register a function reading a :class:`ModelShape` from HF ``config.json`` dicts of ``model_types``."""

    def register(reader: ShapeReader) -> ShapeReader:
        for model_type in model_types:
            SHAPE_READERS[model_type] = reader
        return reader

    return register


def _require(cfg: Mapping[str, Any], *names: str) -> list[Any]:
    """The values of ``names``, refusing a config that lacks one or holds a non-positive size."""
    values = []
    for name in names:
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config {name}={value!r} is not valid for model_type={cfg.get('model_type')!r}; "
                              "expected a positive integer")
        values.append(value)
    return values


def _dropout(cfg: Mapping[str, Any], *names: str) -> bool:
    return any(float(cfg.get(name) or 0.0) > 0 for name in names)


@register_shape_reader("mixtral")
def _mixtral(cfg: Mapping[str, Any]) -> ModelShape:
    """``MixtralForCausalLM``: Llama attention, every MLP a top-k mixture of SwiGLU experts with a linear router."""
    hidden, layers, heads, experts = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_local_experts")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, ffn=cfg.get("intermediate_size", 14336),
        vocab=cfg.get("vocab_size", 32000), max_positions=cfg.get("max_position_embeddings", 32768),
        gated_mlp=True, rope=True, rms_norm=True, norm_bias=False, qkv_bias=False, out_bias=False, mlp_bias=False,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), learned_positions=False,
        act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "attention_dropout"),
        experts=experts, top_k=cfg.get("num_experts_per_tok", 2), expert_ffn=cfg.get("intermediate_size", 14336),
        model_type="mixtral",
    )


@register_shape_reader("qwen2_moe")
def _qwen2_moe(cfg: Mapping[str, Any]) -> ModelShape:
    """``Qwen2MoeForCausalLM``: q/k/v biases, MoE layers every ``decoder_sparse_step`` layers (except
    ``mlp_only_layers``) with a gated shared expert."""
    hidden, layers, heads, experts = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_experts")
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, ffn=cfg.get("intermediate_size", 5632),
        vocab=cfg.get("vocab_size", 151936), max_positions=cfg.get("max_position_embeddings", 32768),
        gated_mlp=True, rope=True, rms_norm=True, norm_bias=False, qkv_bias=bool(cfg.get("qkv_bias", True)),
        out_bias=False, mlp_bias=False, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        learned_positions=False, act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "attention_dropout"),
        experts=experts, top_k=cfg.get("num_experts_per_tok", 4), expert_ffn=cfg.get("moe_intermediate_size", 1408),
        shared_expert_ffn=cfg.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")), moe_layers=moe_layers,
        model_type="qwen2_moe",
    )


@register_shape_reader("deepseek_v3")
def _deepseek_v3(cfg: Mapping[str, Any]) -> ModelShape:
    """``DeepseekV3ForCausalLM``: multi-head latent attention (low-rank query and key/value latents, a shared rope
    key), ``first_k_dense_replace`` dense layers then mixtures of ``n_routed_experts`` fine-grained experts with
    ``n_shared_experts`` shared ones (sigmoid router; its selection bias is a buffer, not a parameter), and
    ``num_nextn_predict_layers`` multi-token prediction modules, which transformers does not build (its counts
    leave them out; ours are trained and kept)."""
    hidden, layers, heads, experts, kv_rank, rope, nope, v_dim = _require(
        cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts", "kv_lora_rank",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    expert_ffn = cfg.get("moe_intermediate_size", 2048)
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=nope + rope,
        ffn=cfg.get("intermediate_size", 18432), vocab=cfg.get("vocab_size", 129280),
        max_positions=cfg.get("max_position_embeddings", 4096), gated_mlp=True, rope=True, rms_norm=True,
        norm_bias=False, qkv_bias=False, out_bias=False, mlp_bias=False,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), learned_positions=False,
        act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "attention_dropout"),
        experts=experts, top_k=cfg.get("num_experts_per_tok", 8), expert_ffn=expert_ffn,
        shared_expert_ffn=(cfg.get("n_shared_experts") or 0) * expert_ffn,
        moe_layers=max(layers - (cfg.get("first_k_dense_replace") or 0), 0),
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=kv_rank, qk_rope_head_dim=rope, v_head_dim=v_dim,
        mtp_layers=cfg.get("num_nextn_predict_layers") or 0, model_type="deepseek_v3",
    )


@register_shape_reader("bert", "roberta")
def _bert(cfg: Mapping[str, Any]) -> ModelShape:
    """``BertForMaskedLM`` / ``RobertaForMaskedLM``: post-norm encoder with biases, learned positions and token
    types, the masked-LM head (dense + norm + tied vocabulary projection with a bias); no pooler."""
    hidden, layers, heads = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    act = cfg.get("hidden_act", "gelu")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=cfg.get("intermediate_size") or 4 * hidden, vocab=cfg.get("vocab_size", 30522),
        max_positions=cfg.get("max_position_embeddings", 512), gated_mlp=False, rope=False, rms_norm=False,
        norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), learned_positions=True,
        act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED),
        dropout=_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
        causal=False,
        token_types=cfg.get("type_vocab_size", 2), head="mlm", post_norm=True, final_norm=False,
        model_type=str(cfg.get("model_type")),
    )


@register_shape_reader("t5", "mt5")
def _t5(cfg: Mapping[str, Any]) -> ModelShape:
    """``T5ForConditionalGeneration`` / ``MT5ForConditionalGeneration``: encoder and decoder stacks of RMS-normed
    layers without biases, relative position buckets in each stack's first layer, a shared embedding, ReLU or
    gated-GELU feed-forward."""
    hidden, layers, heads, head_dim = _require(cfg, "d_model", "num_layers", "num_heads", "d_kv")
    decoder_layers = cfg.get("num_decoder_layers") or layers
    projection = str(cfg.get("feed_forward_proj", "relu"))
    return ModelShape(
        hidden=hidden, layers=decoder_layers, heads=heads, kv_heads=heads, head_dim=head_dim,
        ffn=cfg.get("d_ff", 2048), vocab=cfg.get("vocab_size", 32128), max_positions=0,
        gated_mlp=projection.startswith("gated"), rope=False, rms_norm=True, norm_bias=False, qkv_bias=False,
        out_bias=False, mlp_bias=False, tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        learned_positions=False, act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "dropout_rate"),
        encoder_layers=layers, relative_attention_buckets=cfg.get("relative_attention_num_buckets", 32),
        model_type=str(cfg.get("model_type")),
    )


@register_shape_reader("vit")
def _vit(cfg: Mapping[str, Any]) -> ModelShape:
    """``ViTForImageClassification``: pre-norm encoder over image patches plus a class token, a linear
    classifier on the class token."""
    hidden, layers, heads, image, patch = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "image_size", "patch_size")
    channels = cfg.get("num_channels", 3)
    patches = (image // patch) ** 2
    act = cfg.get("hidden_act", "gelu")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=cfg.get("intermediate_size") or 4 * hidden, vocab=0, max_positions=patches + 1, gated_mlp=False,
        rope=False, rms_norm=False, norm_bias=True, qkv_bias=bool(cfg.get("qkv_bias", True)), out_bias=True,
        mlp_bias=True, tied_embeddings=False, learned_positions=True,
        act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED),
        dropout=_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
        causal=False,
        head="classifier", num_labels=len(cfg.get("id2label") or {}) or 2, patch_inputs=channels * patch * patch,
        model_type="vit",
    )


def image_sequence_length(shape: ModelShape) -> int:
    """Tokens a vision encoder sees per image (patches + class token); 0 for text models."""
    return shape.max_positions if shape.patch_inputs else 0


def shape_from_config(config: Any) -> ModelShape:
    """The shape of a model config (a ``PretrainedConfig``): one of our families' as the family reads it (its
    ``planner_config``, the HF config of the same shape), a transformers one by the reader of its ``model_type``;
    GPT-style configs field by field."""
    model_type = getattr(config, "model_type", None)
    family = registry.family_for_model_type(str(model_type)) if model_type else None
    if family is not None and family.planner_config is not None and model_type == family.config_class.model_type:
        return replace(shape_from_hf_dict(family.planner_config(config)), model_type=str(model_type))
    if model_type in SHAPE_READERS:
        return SHAPE_READERS[model_type](config.to_dict())
    return ModelShape.from_config(config)


def shape_from_hf_dict(cfg: Mapping[str, Any], where: str = "config.json") -> ModelShape:
    """The shape of the model an HF ``config.json`` dict describes.

    Types our families convert are read through the family's converter (the same model we would build); the
    others through :data:`SHAPE_READERS`.
    """
    model_type = cfg.get("model_type")
    family = registry.family_for_model_type(str(model_type)) if model_type else None
    if model_type in SHAPE_READERS:  # a reader of its own (architectures beyond the GPT-style field set)
        return SHAPE_READERS[str(model_type)](cfg)
    if family is not None and family.converter is not None and model_type in family.hf_types:
        return replace(shape_from_config(family.converter.config_from_hf(dict(cfg))), model_type=str(model_type))
    if family is not None and model_type == family.config_class.model_type:
        return shape_from_config(family.config_class(**{k: v for k, v in cfg.items() if k != "model_type"}))
    known = sorted({*SHAPE_READERS, *registry.all_model_types()})
    raise ConfigError(f"model_type={model_type!r} in {where} is not one the planner reads; choose one of: "
                      f"{', '.join(known)}")


def as_shape(model: Any) -> ModelShape:
    """``model`` as a :class:`ModelShape`: a shape, an HF ``config.json`` dict or one of our model configs."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping):
        return shape_from_hf_dict(model)
    return shape_from_config(model)
