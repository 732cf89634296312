"""HF <-> mindformers_py conversion for the ViT family: transformers' ``vit`` checkpoints.

transformers writes ViT checkpoints with the original names (``vit.encoder.layer.0.attention.attention.query``,
``intermediate.dense``, ``layernorm_before``, ...) and, since version 5, builds its modules with newer ones
(``vit.layers.0.attention.q_proj``, ``mlp.fc1``); both load here. Ours are the shared layers' Llama-style names
(``model.layers.0.self_attn.q_proj``, ``mlp.up_proj``, ``input_layernorm``); every tensor keeps its layout, so the
mapping is renaming only. Export writes the original names, which every transformers version loads.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import CheckpointError, ConfigError
from ..hf_config import carry_general_fields
from .configuration_vit import ViTConfig

SUPPORTED_HF_TYPES = ("vit",)
HF_PREFIX = "vit."
# HF config field -> ours (same meaning; the aliases of ViTConfig).
_CONFIG_FIELDS = {
    "image_size": "image_size", "patch_size": "patch_size", "num_channels": "num_channels", "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size", "hidden_act": "hidden_act", "layer_norm_eps": "norm_eps",
    "qkv_bias": "attention_bias", "hidden_dropout_prob": "hidden_dropout",
    "attention_probs_dropout_prob": "attention_dropout", "initializer_range": "initializer_range",
    "pooler_output_size": "pooler_output_size", "pooler_act": "pooler_act", "encoder_stride": "encoder_stride",
}


# --------------------------------------------------------------------------- configs
def config_from_hf(hf: dict[str, Any]) -> ViTConfig:
    """Our :class:`ViTConfig` for an HF ``config.json`` dict of model type ``vit``."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_HF_TYPES:
        raise ConfigError(f"model_type={kind!r} is not a supported HF architecture for the ViT family; supported: "
                          f"{', '.join(SUPPORTED_HF_TYPES)}")
    if isinstance(hf.get("patch_size"), (list, tuple)):
        raise ConfigError(f"patch_size={hf['patch_size']!r} is not supported: ViT checkpoints with non-square patches "
                          "cannot interpolate their positions; expected one integer")
    config = ViTConfig(**{ours: hf[theirs] for theirs, ours in _CONFIG_FIELDS.items() if hf.get(theirs) is not None})
    return carry_general_fields(hf, config)


def hf_type_for(config: ViTConfig) -> str:
    """The HF architecture a config exports to (always ``vit``)."""
    return "vit"


def config_to_hf(config: ViTConfig):
    """transformers' ``ViTConfig`` equivalent to ``config``."""
    import transformers

    kwargs = {theirs: getattr(config, ours) for theirs, ours in _CONFIG_FIELDS.items()}
    return carry_general_fields(config, transformers.ViTConfig(**kwargs))


# --------------------------------------------------------------------------- weights
# (HF pattern, ours) for the base model; {i} is the layer index, {p} weight or bias. The first group is the
# checkpoint format (and the one exported), the second transformers 5's module names.
_RENAMES = [
    ("embeddings.cls_token", "embeddings.cls_token"),
    ("embeddings.position_embeddings", "embeddings.position_embeddings"),
    ("embeddings.mask_token", "embeddings.mask_token"),
    ("embeddings.patch_embeddings.projection.{p}", "embeddings.projection.{p}"),
    ("encoder.layer.{i}.attention.attention.query.{p}", "layers.{i}.self_attn.q_proj.{p}"),
    ("encoder.layer.{i}.attention.attention.key.{p}", "layers.{i}.self_attn.k_proj.{p}"),
    ("encoder.layer.{i}.attention.attention.value.{p}", "layers.{i}.self_attn.v_proj.{p}"),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.self_attn.o_proj.{p}"),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.mlp.up_proj.{p}"),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.mlp.down_proj.{p}"),
    ("encoder.layer.{i}.layernorm_before.{p}", "layers.{i}.input_layernorm.{p}"),
    ("encoder.layer.{i}.layernorm_after.{p}", "layers.{i}.post_attention_layernorm.{p}"),
    ("layernorm.{p}", "norm.{p}"),
    ("pooler.dense.{p}", "pooler.dense.{p}"),
]
_MODULAR_RENAMES = [
    ("layers.{i}.attention.q_proj.{p}", "layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attention.k_proj.{p}", "layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attention.v_proj.{p}", "layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attention.o_proj.{p}", "layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.mlp.fc1.{p}", "layers.{i}.mlp.up_proj.{p}"),
    ("layers.{i}.mlp.fc2.{p}", "layers.{i}.mlp.down_proj.{p}"),
    ("layers.{i}.layernorm_before.{p}", "layers.{i}.input_layernorm.{p}"),
    ("layers.{i}.layernorm_after.{p}", "layers.{i}.post_attention_layernorm.{p}"),
]
_HEADS = ("classifier.", "decoder.")  # image classification; masked image modelling's pixel decoder


def _regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


_HF_TO_OURS = [(_regex(h), o) for h, o in _RENAMES + _MODULAR_RENAMES]
_OURS_TO_HF = [(_regex(o), h) for h, o in _RENAMES]


def _rename(key: str, rules) -> str | None:
    for regex, target in rules:
        m = regex.match(key)
        if m:
            return target.format(**m.groupdict())
    return None


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Map an HF ViT state dict (base model or a head, either naming) to our parameter names. In a head model's
    checkpoint (base model under ``vit.``) the tensors beside it belong to heads and keep their names, so loading
    into another head skips them, as transformers does."""
    headed = any(key.startswith(HF_PREFIX) for key in hf_state)
    out = {}
    for key, value in hf_state.items():
        if key.startswith(_HEADS) or (headed and not key.startswith(HF_PREFIX)):
            out[key] = value
            continue
        body = key.removeprefix(HF_PREFIX)
        new = _rename(body, _HF_TO_OURS)
        if new is None:
            raise CheckpointError(f"unexpected tensor {key!r} in the vit checkpoint")
        out[f"model.{new}"] = value
    return out


def state_dict_to_hf(state: dict[str, torch.Tensor], config: ViTConfig, task: str | None = None) -> dict[str, torch.Tensor]:
    """Map our state dict (of the ``task`` head, a registry task name, or ``"base"``) to the names transformers'
    ViT checkpoints use; a head model's base model sits under ``vit.``, a base model's at the top."""
    prefix = "" if task == "base" else HF_PREFIX
    out = {}
    for key, value in state.items():
        if key.startswith(_HEADS):
            out[key] = value
            continue
        new = _rename(key.removeprefix("model."), _OURS_TO_HF)
        if new is None:
            raise CheckpointError(f"tensor {key!r} has no place in a vit checkpoint")
        out[prefix + new] = value
    return out
