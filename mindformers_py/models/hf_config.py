"""The settings every transformers config has, carried between an HF config and ours in both directions.

A family's converter translates the architecture (sizes, norms, positions, ...); what transformers keeps on
every ``PretrainedConfig`` whatever the architecture (output switches, label maps, special token ids, caching,
the legacy ``gradient_checkpointing`` flag, the attention implementation, ...) means the same on both sides and is
copied here, once for every family, so ``from_pretrained(dir, config=GPT2Config(..., output_hidden_states=True))``
behaves as it does in transformers.

:func:`own_config` is how our model classes accept an HF config (``GPTForCausalLM(LlamaConfig(...))``,
``AutoModelForCausalLM.from_config(LlamaConfig(...))``): converted by the family's converter, as a checkpoint's
``config.json`` is.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError

GENERAL_FIELDS: tuple[str, ...] = (
    "return_dict", "output_hidden_states", "output_attentions", "dtype", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "tie_word_embeddings",
    "use_cache", "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "gradient_checkpointing",
)
"""Keys transformers gives the same meaning on every config (its ``PretrainedConfig`` fields and the common keyword
arguments it keeps as attributes). Copied when the source has them; a family's converter may still refuse a value
its architecture cannot run."""

_INTERNAL = ("_attn_implementation_internal",)
"""Set on config objects by ``attn_implementation=``; never in a ``config.json``. (transformers' expert kernel
choice, ``experts_implementation``, is not carried: our MoE layer has its own.)"""


def _as_dict(source: PretrainedConfig | Mapping[str, Any]) -> dict[str, Any]:
    return source.to_dict() if isinstance(source, PretrainedConfig) else dict(source)


def carry_general_fields(source: PretrainedConfig | Mapping[str, Any], target: PretrainedConfig) -> PretrainedConfig:
    """Copy the :data:`GENERAL_FIELDS` that ``source`` (a config or a ``config.json`` dict) has onto ``target``,
    and, from a config object, its attention implementation; returns ``target``."""
    values = _as_dict(source)
    if isinstance(source, PretrainedConfig):
        for name in _INTERNAL:
            value = source.__dict__.get(name)
            if value is not None:
                setattr(target, name.removesuffix("_internal"), value)
    for name in GENERAL_FIELDS:
        if name not in values:
            continue
        value = values[name]
        if name == "id2label" and value is not None:
            value = {int(k): v for k, v in value.items()}
        elif name == "dtype" and isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            value = getattr(torch, value)
        elif name == "output_attentions" and value and target._attn_implementation not in (None, "eager"):
            continue  # transformers refuses it beside SDPA; the attention implementation says it
        setattr(target, name, value)
    return target


def own_config(config_class: type[PretrainedConfig], config: Any) -> Any:
    """``config`` as an instance of our ``config_class``: our own config as it is; a transformers config of an
    architecture the family converts (``LlamaConfig`` for the GPT family, ...) through the family's converter; anything
    else refused in one line. Non-config values are returned unchanged (the model's own error follows)."""
    if not isinstance(config, PretrainedConfig) or isinstance(config, config_class):
        return config
    from . import registry

    family = next((f for f in registry.FAMILIES if issubclass(config_class, f.config_class)), None)
    if family is None or config.model_type not in family.hf_types:
        accepted = [config_class.__name__] + [f"transformers' {t} config" for t in (family.hf_types if family else ())]
        raise ConfigError(f"a {type(config).__name__} (model_type={config.model_type!r}) cannot build this model; "
                          f"pass a {' or '.join(accepted)}")
    ours = carry_general_fields(config, family.converter.config_from_hf(config.to_dict()))
    ours._name_or_path = config.name_or_path
    return ours
