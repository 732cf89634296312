"""HF <-> mindformers_py conversion for the T5 family: ``t5`` (v1, v1.1, FLAN-T5) and ``mt5`` checkpoints.

transformers nests each sublayer (``block.{i}.layer.{j}``) and keeps the relative position bias in the first
block's attention; ours names the sublayers like every other family (``self_attn``, ``cross_attn``, ``mlp`` and
their norms) and keeps one bias per stack (``position_bias``). The tensors themselves are the same (T5 has no fused
or transposed projections), so conversion is renaming.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import ConfigError, MindFormersError
from ..hf_config import carry_general_fields
from .configuration_t5 import T5Config

SUPPORTED_HF_TYPES = ("t5", "mt5")
_SPECIAL_TOKEN_FIELDS = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id")
# (HF config key, our field) copied as they are.
_FIELDS = (
    ("vocab_size", "vocab_size"), ("d_model", "hidden_size"), ("d_kv", "head_dim"), ("d_ff", "intermediate_size"),
    ("num_layers", "num_hidden_layers"), ("num_decoder_layers", "num_decoder_layers"), ("num_heads", "num_attention_heads"),
    ("relative_attention_num_buckets", "relative_attention_num_buckets"),
    ("relative_attention_max_distance", "relative_attention_max_distance"), ("dropout_rate", "dropout_rate"),
    ("layer_norm_epsilon", "norm_eps"), ("initializer_factor", "initializer_factor"),
    ("feed_forward_proj", "feed_forward_proj"), ("n_positions", "max_position_embeddings"),
    ("task_specific_params", "task_specific_params"), ("prefix", "prefix"), ("use_cache", "use_cache"),
)


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict[str, Any]) -> T5Config:
    """Our :class:`T5Config` for an HF ``config.json`` dict of a ``t5`` or ``mt5`` checkpoint.

    Embedding tying and the output scaling follow transformers 5: a ``t5`` config scales the decoder output when
    it ties (or as its ``scale_decoder_outputs`` says), ``mt5`` never scales."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_HF_TYPES:
        raise ConfigError(f"model_type={kind!r} is not a supported HF architecture for the T5 family; supported: "
                          f"{', '.join(SUPPORTED_HF_TYPES)}")
    kwargs = {ours: hf[theirs] for theirs, ours in _FIELDS if hf.get(theirs) is not None}
    tied = hf.get("tie_word_embeddings", True)
    kwargs["tie_word_embeddings"] = bool(tied)
    kwargs["scale_decoder_outputs"] = False if kind == "mt5" else hf.get("scale_decoder_outputs", bool(tied))
    for field in _SPECIAL_TOKEN_FIELDS:  # kept as written, None included (a missing decoder_start_token_id stays missing)
        kwargs[field] = hf.get(field)
    return carry_general_fields(hf, T5Config(hf_architecture=kind, **kwargs))


def hf_type_for(config: T5Config) -> str:
    """The HF architecture a config exports to: where it came from, else ``t5``."""
    return config.hf_architecture or "t5"


def config_to_hf(config: T5Config):
    """A transformers ``T5Config`` / ``MT5Config`` equivalent to ``config``."""
    import transformers

    kind = hf_type_for(config)
    if kind == "mt5" and config.scales_decoder_outputs:
        raise MindFormersError("cannot export to HF mt5: it never scales the decoder output, the model has "
                               "scale_decoder_outputs=True; export as t5")
    kwargs = {theirs: getattr(config, ours) for theirs, ours in _FIELDS}
    kwargs.update({field: getattr(config, field) for field in _SPECIAL_TOKEN_FIELDS})
    kwargs["tie_word_embeddings"] = config.tie_word_embeddings
    if kind == "mt5":
        return carry_general_fields(config, transformers.MT5Config(**kwargs))
    hf = carry_general_fields(config, transformers.T5Config(**kwargs))
    hf.scale_decoder_outputs = config.scales_decoder_outputs
    hf.tie_word_embeddings = config.tie_word_embeddings  # transformers 5 forces True; saved as ours says
    return hf


# --------------------------------------------------------------------------- weights
_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_FF = {"wi": "up_proj", "wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}


def _block_to_ours(stack: str, i: str, sub: str, rest: str, gated: bool) -> str | None:
    """Our name of ``{stack}.block.{i}.layer.{sub}.{rest}``; None for tensors we do not keep."""
    ff_sub = "2" if stack == "decoder" else "1"
    base = f"model.{stack}.layers.{i}"
    if sub == "0":
        if rest == "layer_norm.weight":
            return f"{base}.input_layernorm.weight"
        m = re.fullmatch(r"SelfAttention\.([qkvo])\.weight", rest)
        if m:
            return f"{base}.self_attn.{_ATTN[m.group(1)]}.weight"
        if rest == "SelfAttention.relative_attention_bias.weight":
            return f"model.{stack}.position_bias.relative_attention_bias.weight" if i == "0" else None
    elif sub == "1" and stack == "decoder":
        if rest == "layer_norm.weight":
            return f"{base}.cross_attn_layernorm.weight"
        m = re.fullmatch(r"EncDecAttention\.([qkvo])\.weight", rest)
        if m:
            return f"{base}.cross_attn.{_ATTN[m.group(1)]}.weight"
        if rest == "EncDecAttention.relative_attention_bias.weight":
            return None  # a bias transformers' cross-attention never uses (its checkpoints may carry one)
    elif sub == ff_sub:
        if rest == "layer_norm.weight":
            return f"{base}.post_attention_layernorm.weight"
        m = re.fullmatch(r"DenseReluDense\.(wi|wi_0|wi_1|wo)\.weight", rest)
        if m and m.group(1) in (("wi_0", "wi_1", "wo") if gated else ("wi", "wo")):
            return f"{base}.mlp.{_FF[m.group(1)]}.weight"
    raise MindFormersError(f"unexpected tensor {stack}.block.{i}.layer.{sub}.{rest} in the T5 checkpoint")


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config: T5Config) -> dict[str, torch.Tensor]:
    """Map an HF T5/mT5 state dict (``T5ForConditionalGeneration``, ``T5Model`` or ``T5EncoderModel``) to our names.

    As transformers 5 does, a checkpoint holding an ``lm_head.weight`` different from ``shared.weight`` keeps its
    head untied whatever its config says (configs saved by transformers 5 always say ``tie_word_embeddings=true``):
    ``config.tie_word_embeddings`` is set to False then."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        key = key.removeprefix("transformer.")
        if key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            continue  # copies of shared.weight
        if key == "shared.weight":
            out["model.shared.weight"] = value
        elif key == "lm_head.weight":
            out["lm_head.weight"] = value
        elif key in ("encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"):
            out[f"model.{key.split('.')[0]}.norm.weight"] = value
        else:
            m = re.fullmatch(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)", key)
            if m is None:
                raise MindFormersError(f"unexpected tensor {key!r} in the T5 checkpoint")
            name = _block_to_ours(*m.groups(), gated=config.gated_mlp)
            if name is not None:
                out[name] = value
    head, shared = out.get("lm_head.weight"), out.get("model.shared.weight")
    if config.tie_word_embeddings and head is not None and shared is not None and not torch.equal(head, shared):
        config.tie_word_embeddings = False
        if config.scale_decoder_outputs is None:
            config.scale_decoder_outputs = True  # it tied (and scaled) by its config
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], config: T5Config, task: str | None = None) -> dict[str, torch.Tensor]:
    """Map our state dict (of the ``task`` head: ``seq2seq_lm`` or ``base``) to transformers' T5 names (a tied
    head written once, as ``shared.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            if not config.tie_word_embeddings:
                out[key] = value
            continue
        name = key.removeprefix("model.")
        if name == "shared.weight":
            out[name] = value
            continue
        m = re.fullmatch(r"(encoder|decoder)\.norm\.weight", name)
        if m:
            out[f"{m.group(1)}.final_layer_norm.weight"] = value
            continue
        m = re.fullmatch(r"(encoder|decoder)\.position_bias\.relative_attention_bias\.weight", name)
        if m:
            out[f"{m.group(1)}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = value
            continue
        m = re.fullmatch(r"(encoder|decoder)\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise MindFormersError(f"tensor {key!r} has no place in a T5 checkpoint")
        stack, i, rest = m.groups()
        out[f"{stack}.block.{i}.layer.{_hf_sublayer(stack, rest, config.gated_mlp)}"] = value
    return out


def _hf_sublayer(stack: str, rest: str, gated: bool) -> str:
    """transformers' ``{sub}.{name}`` of our block-relative parameter name ``rest``."""
    ff = "2" if stack == "decoder" else "1"
    m = re.fullmatch(r"(self_attn|cross_attn)\.([qkvo])_proj\.weight", rest)
    if m:
        return f"0.SelfAttention.{m.group(2)}.weight" if m.group(1) == "self_attn" else f"1.EncDecAttention.{m.group(2)}.weight"
    norms = {"input_layernorm.weight": "0", "cross_attn_layernorm.weight": "1", "post_attention_layernorm.weight": ff}
    if rest in norms:
        return f"{norms[rest]}.layer_norm.weight"
    m = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.weight", rest)
    if m:
        hf = {"gate_proj": "wi_0", "up_proj": "wi_1" if gated else "wi", "down_proj": "wo"}[m.group(1)]
        return f"{ff}.DenseReluDense.{hf}.weight"
    raise MindFormersError(f"tensor {stack}.layers.*.{rest} has no place in a T5 checkpoint")
