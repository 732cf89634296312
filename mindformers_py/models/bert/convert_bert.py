"""HF <-> mindformers_py conversion for the BERT family: BERT and RoBERTa checkpoints, every head.

Our layers use Llama-style module names, so HF's ``attention.self.query`` becomes ``self_attn.q_proj``,
``intermediate.dense`` ``mlp.up_proj`` and so on (:data:`_LAYER_RENAMES`); the tables below are read in both
directions. RoBERTa's classification head (``classifier.dense`` + ``classifier.out_proj``) is BERT's pooler +
classifier with a dropout before the dense layer, so it maps onto ``model.pooler`` and ``classifier``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import ConfigError, MindFormersError
from ..hf_config import carry_general_fields
from .configuration_bert import BertConfig

SUPPORTED_HF_TYPES = ("bert", "roberta")
# Config fields with the same name and meaning on both sides.
_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "hidden_act", "max_position_embeddings", "type_vocab_size", "initializer_range", "pad_token_id",
                  "bos_token_id", "eos_token_id", "classifier_dropout", "tie_word_embeddings")
_HF_PREFIX = {"bert": "bert", "roberta": "roberta"}

# (HF name inside the base model, ours inside the base model); {i} is the layer index, {p} weight or bias.
_LAYER_RENAMES = [
    ("embeddings.word_embeddings.weight", "embed_tokens.weight"),
    ("embeddings.position_embeddings.weight", "embed_positions.weight"),
    ("embeddings.token_type_embeddings.weight", "embed_token_types.weight"),
    ("embeddings.LayerNorm.{p}", "drop.norm.{p}"),
    ("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.self_attn.q_proj.{p}"),
    ("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.self_attn.k_proj.{p}"),
    ("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.self_attn.v_proj.{p}"),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.self_attn.o_proj.{p}"),
    ("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.post_attention_layernorm.{p}"),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.mlp.up_proj.{p}"),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.mlp.down_proj.{p}"),
    ("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.post_feedforward_layernorm.{p}"),
    ("encoder.layer.{i}.crossattention.self.query.{p}", "layers.{i}.cross_attn.q_proj.{p}"),
    ("encoder.layer.{i}.crossattention.self.key.{p}", "layers.{i}.cross_attn.k_proj.{p}"),
    ("encoder.layer.{i}.crossattention.self.value.{p}", "layers.{i}.cross_attn.v_proj.{p}"),
    ("encoder.layer.{i}.crossattention.output.dense.{p}", "layers.{i}.cross_attn.o_proj.{p}"),
    ("encoder.layer.{i}.crossattention.output.LayerNorm.{p}", "layers.{i}.cross_attn_layernorm.{p}"),
    ("pooler.dense.{p}", "pooler.dense.{p}"),
]
# (HF head name, ours), per architecture. The MLM output bias is stored by HF as ``<head>.bias`` (tied to
# ``<head>.decoder.bias``); ours is the decoder's own bias.
_HEAD_RENAMES = {
    "bert": [
        ("cls.predictions.transform.dense.{p}", "lm_head.dense.{p}"),
        ("cls.predictions.transform.LayerNorm.{p}", "lm_head.norm.{p}"),
        ("cls.predictions.decoder.weight", "lm_head.decoder.weight"),
        ("cls.predictions.bias", "lm_head.decoder.bias"),
        ("cls.seq_relationship.{p}", "nsp_head.{p}"),
        ("classifier.{p}", "classifier.{p}"),
        ("qa_outputs.{p}", "qa_outputs.{p}"),
    ],
    "roberta": [
        ("lm_head.dense.{p}", "lm_head.dense.{p}"),
        ("lm_head.layer_norm.{p}", "lm_head.norm.{p}"),
        ("lm_head.decoder.weight", "lm_head.decoder.weight"),
        ("lm_head.bias", "lm_head.decoder.bias"),
        ("classifier.dense.{p}", "model.pooler.dense.{p}"),
        ("classifier.out_proj.{p}", "classifier.{p}"),
        ("classifier.{p}", "classifier.{p}"),
        ("qa_outputs.{p}", "qa_outputs.{p}"),
    ],
}
# HF tensors that are not weights: buffers some checkpoints store, and decoder biases duplicated under a second name.
_SKIPPED = re.compile(r"(embeddings\.(position_ids|token_type_ids)|(cls\.predictions|lm_head)\.decoder\.bias)$")


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


def _rules(pairs: list[tuple[str, str]], reverse: bool = False) -> list[tuple[re.Pattern, str]]:
    return [(_regex(ours if reverse else hf), hf if reverse else ours) for hf, ours in pairs]


_FROM_HF_LAYERS = _rules(_LAYER_RENAMES)
_TO_HF_LAYERS = _rules(_LAYER_RENAMES, reverse=True)
_FROM_HF_HEADS = {kind: _rules(pairs) for kind, pairs in _HEAD_RENAMES.items()}
# Export: RoBERTa's token classifier is a plain ``classifier`` while its sequence classifier is ``classifier.dense`` +
# ``classifier.out_proj``, so its classifier rules are chosen by task (see state_dict_to_hf).
_TO_HF_HEADS = {kind: _rules([(h, o) for h, o in pairs if not (kind == "roberta" and h.startswith("classifier"))],
                             reverse=True) for kind, pairs in _HEAD_RENAMES.items()}


def _rename(key: str, rules: list[tuple[re.Pattern, str]]) -> str | None:
    for regex, target in rules:
        m = regex.match(key)
        if m:
            return target.format(**m.groupdict())
    return None


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict[str, Any]) -> BertConfig:
    """Our :class:`BertConfig` for an HF ``config.json`` dict of a BERT or RoBERTa checkpoint."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_HF_TYPES:
        raise ConfigError(f"model_type={kind!r} is not a supported HF architecture for the BERT family; supported: "
                          f"{', '.join(SUPPORTED_HF_TYPES)}")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{kind} checkpoints with position_embedding_type={hf['position_embedding_type']!r} are not "
                          "supported; supported: 'absolute'")
    kwargs = {k: hf[k] for k in _SHARED_FIELDS if k in hf}
    kwargs["hidden_dropout"] = hf.get("hidden_dropout_prob", 0.1)
    kwargs["attention_dropout"] = hf.get("attention_probs_dropout_prob", 0.1)
    kwargs["norm_eps"] = hf.get("layer_norm_eps", 1e-12)
    if kind == "roberta":
        classifier = hf.get("classifier_dropout")
        kwargs.update(padded_positions=True, mlm_head_act="gelu",
                      pooler_dropout=kwargs["hidden_dropout"] if classifier is None else classifier)
        kwargs.setdefault("pad_token_id", 1)
    return carry_general_fields(hf, BertConfig(hf_architecture=kind, **kwargs))


def hf_type_for(config: BertConfig) -> str:
    """The HF architecture a config exports to: where it came from, else by its position scheme."""
    if config.hf_architecture:
        return config.hf_architecture
    return "roberta" if config.padded_positions else "bert"


def config_to_hf(config: BertConfig):
    """A transformers ``BertConfig`` or ``RobertaConfig`` equivalent to ``config``."""
    import transformers

    kind = hf_type_for(config)
    _check_exportable(config, kind)
    kwargs = {k: getattr(config, k) for k in _SHARED_FIELDS}
    kwargs.update(hidden_dropout_prob=config.hidden_dropout, attention_probs_dropout_prob=config.attention_dropout,
                  layer_norm_eps=config.norm_eps, position_embedding_type="absolute")
    cls = transformers.RobertaConfig if kind == "roberta" else transformers.BertConfig
    return carry_general_fields(config, cls(**kwargs))


def _check_exportable(config: BertConfig, kind: str) -> None:
    """Refuse exports the HF class could not represent (rather than writing a silently different model)."""
    wanted = dict(norm_type="layernorm", norm_bias=True, gated_mlp=False, attention_bias=True, attention_out_bias=True,
                  mlp_bias=True, num_key_value_heads=config.num_attention_heads,
                  head_dim=config.hidden_size // config.num_attention_heads, padded_positions=kind == "roberta")
    if kind == "bert":
        wanted.update(pooler_dropout=0.0, mlm_head_act=config.mlm_head_act if config.mlm_head_act in (None, config.hidden_act)
                      else config.hidden_act)
    else:
        wanted.update(mlm_head_act=config.mlm_head_act if config.mlm_head_act in (None, "gelu") else "gelu")
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise MindFormersError(f"cannot export to HF {kind}: it needs {field}={value!r}, the model has {getattr(config, field)!r}")


# --------------------------------------------------------------------------- weights
def _canonical(key: str) -> str:
    """TF-era checkpoints name LayerNorm parameters gamma/beta."""
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """Map an HF BERT/RoBERTa state dict (a base model or any head) to our parameter names."""
    kind = hf_type_for(config)
    prefix = _HF_PREFIX[kind] + "."
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        key = _canonical(key)
        if _SKIPPED.search(key):
            continue
        body = key[len(prefix):] if key.startswith(prefix) else key
        new = _rename(body, _FROM_HF_LAYERS)
        if new is not None:
            out[f"model.{new}"] = value
            continue
        new = _rename(key, _FROM_HF_HEADS[kind])
        if new is None:
            raise MindFormersError(f"unexpected tensor {key!r} in the {kind} checkpoint")
        out[new] = value
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], config: BertConfig, task: str | None = None) -> dict[str, torch.Tensor]:
    """Map our state dict (of the ``task`` head, a registry task name) to the HF architecture's names; a tied MLM
    decoder weight is written once (as the word embedding)."""
    kind = hf_type_for(config)
    prefix = _HF_PREFIX[kind]
    head_rules = list(_TO_HF_HEADS[kind])
    if kind == "roberta":
        if task == "sequence_classification":  # RoBERTa's classification head holds our pooler
            head_rules.insert(0, (_regex("model.pooler.dense.{p}"), "classifier.dense.{p}"))
            head_rules.append((_regex("classifier.{p}"), "classifier.out_proj.{p}"))
        else:
            head_rules.append((_regex("classifier.{p}"), "classifier.{p}"))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "lm_head.decoder.weight" and config.tie_word_embeddings:
            continue
        new = _rename(key, head_rules)
        if new is not None:
            out[new] = value
            continue
        body = _rename(key.removeprefix("model."), _TO_HF_LAYERS)
        if body is None:
            raise MindFormersError(f"tensor {key!r} has no place in a {kind} checkpoint")
        out[f"{prefix}.{body}"] = value
    return out
