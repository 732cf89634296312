"""Auto classes: one entry point for presets, our checkpoints and HF checkpoints of the architectures we cover.

``AutoModelForCausalLM.from_pretrained(x)`` accepts a preset name (random init), a folder saved by us, or a
folder holding an HF checkpoint (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ...), which is converted on load.
Our model types are also registered with transformers' own Auto classes, so
``transformers.AutoModelForCausalLM.from_pretrained(folder_saved_by_us)`` returns our model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from .errors import CheckpointError, ConfigError, MindFormersError
from .models import registry
from .models.registry import Family
from .utils.safetensors_io import load_state_dict

_HEAD_PREFIXES = ("model.", "lm_head.", "score.")


def _read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a checkpoint folder or a preset ({', '.join(registry.all_presets())})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None


def _family_of(model_type: str | None, where: str) -> Family:
    family = registry.family_for_model_type(model_type or "")
    if family is None:
        raise ConfigError(f"model_type={model_type!r} in {where} is not supported; supported: {', '.join(registry.all_model_types())}")
    return family


def resolve_config(name_or_path: str | os.PathLike, **overrides: Any) -> tuple[PretrainedConfig, Family, bool]:
    """(our config, its family, whether the source is an HF checkpoint) for a preset name or a folder.

    ``overrides`` are config fields; for a preset they take part in deriving the other sizes (``hidden_size``
    changes ``head_dim``), for a checkpoint they replace stored values (dropout, labels, ...).
    """
    path = Path(name_or_path)
    if path.is_dir():
        raw = _read_config_json(path)
        family = _family_of(raw.get("model_type"), str(path / "config.json"))
        _check_fields(family.config_class, overrides)
        from_hf = raw.get("model_type") != family.config_class.model_type
        if from_hf:
            config = family.converter.config_from_hf(raw)
            for key, value in overrides.items():
                setattr(config, key, value)
        else:
            config = family.config_class.from_dict({**raw, **overrides})
        return config, family, from_hf
    family = registry.family_for_preset(str(name_or_path))
    if family is None:
        raise ConfigError(f"{str(name_or_path)!r} is neither a checkpoint folder nor a preset; presets: {', '.join(registry.all_presets())}")
    _check_fields(family.config_class, overrides)
    return family.config_class(**{**family.presets[str(name_or_path)], **overrides}), family, False


def _check_fields(config_class: type[PretrainedConfig], overrides: dict[str, Any]) -> None:
    probe = config_class()
    for key in overrides:
        if not hasattr(probe, key):
            fields = [f for f in getattr(config_class, "__dataclass_fields__", {}) if not f.startswith("_")]
            raise ConfigError(f"unknown config field {key!r} for {config_class.__name__}; valid: {', '.join(fields)}")


class AutoConfig:
    """Configs by preset name, checkpoint folder or model type."""

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **overrides: Any) -> PretrainedConfig:
        """Our config for a preset name, our checkpoint folder or an HF checkpoint folder (converted)."""
        return resolve_config(name_or_path, **overrides)[0]

    @classmethod
    def for_model(cls, model_type_or_preset: str, **kwargs: Any) -> PretrainedConfig:
        """A config for one of our model types (e.g. ``"mindformers_gpt"``) or a preset, with ``kwargs`` applied."""
        family = registry.family_for_preset(model_type_or_preset)
        if family is not None:
            return family.config_class(**{**family.presets[model_type_or_preset], **kwargs})
        for family in registry.FAMILIES:
            if family.config_class.model_type == model_type_or_preset:
                return family.config_class(**kwargs)
        valid = [f.config_class.model_type for f in registry.FAMILIES] + registry.all_presets()
        raise ConfigError(f"model_type={model_type_or_preset!r} is not known; choose one of: {', '.join(valid)}")

    @classmethod
    def show_support_list(cls) -> dict[str, list[str]]:
        """Print and return the presets of each family (and the HF architectures it loads)."""
        table = {f.name: list(f.presets) for f in registry.FAMILIES}
        for f in registry.FAMILIES:
            print(f"{f.name}: presets {', '.join(f.presets)}; loads HF {', '.join(f.hf_types) or '-'}")
        return table


class _AutoModel:
    """Base of the Auto model classes; ``_task`` picks the head."""

    _task = "base"

    @classmethod
    def _model_class(cls, family: Family) -> type[PreTrainedModel]:
        try:
            return family.model_classes[cls._task]
        except KeyError:
            raise ConfigError(f"the {family.name} family has no {cls._task} model; it has: {', '.join(family.model_classes)}") from None

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
        """A randomly initialised model for ``config``."""
        family = _family_of(getattr(config, "model_type", None), type(config).__name__)
        return cls._model_class(family)(config, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                        torch_dtype: torch.dtype | str | None = None, **config_overrides: Any) -> PreTrainedModel:
        """Load a preset (random init), our checkpoint, or an HF checkpoint (converted), in eval mode."""
        config, family, from_hf = resolve_config(name_or_path, **config_overrides)
        model = cls._model_class(family)(config)
        folder = Path(name_or_path)
        if folder.is_dir():
            state = load_state_dict(folder)
            if from_hf:
                state = family.converter.state_dict_from_hf(state, config)
            _load_into(model, state, folder)
            if (folder / "generation_config.json").is_file():
                model.generation_config = GenerationConfig.from_pretrained(folder)
        dtype = dtype or torch_dtype
        if dtype is not None:
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        return model.eval()


def _load_into(model: PreTrainedModel, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Load a full-model-keyed state dict into ``model`` (a base model or one with a head), checking every tensor."""
    # Normalise to full-model keys ("model.*", heads), whatever class saved the checkpoint.
    state = {k if k.startswith(_HEAD_PREFIXES) else f"model.{k}": v for k, v in state.items()}
    is_base = not any(k.startswith(_HEAD_PREFIXES) for k in model.state_dict())
    if is_base:
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    expected = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and "lm_head.weight" in expected:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
                  for k, v in state.items() if k in expected and v is not None and v.shape != expected[k].shape]
    if mismatched:
        raise CheckpointError(f"weights in {folder} do not match the config: {mismatched[0]} ({len(mismatched)} tensors differ)")
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    # A head that the checkpoint lacks (e.g. a classifier on a pretrained LM) starts from its random init, as in HF.
    missing_body = [k for k in missing if k.startswith("model.") or (is_base and not k.startswith(("lm_head.", "score.")))]
    if missing_body:
        raise CheckpointError(f"weights in {folder} do not match the config: missing {missing_body[0]} ({len(missing_body)} tensors missing)")
    if unexpected and not all(k.startswith(("lm_head.", "score.")) for k in unexpected):
        raise CheckpointError(f"weights in {folder} do not match the config: unexpected {unexpected[0]} ({len(unexpected)} extra tensors)")
    with torch.no_grad():
        for key, value in state.items():
            if key in expected and value is not None:
                expected[key].copy_(value)


class AutoModel(_AutoModel):
    """The bare model (hidden states) of a family."""

    _task = "base"


class AutoModelForCausalLM(_AutoModel):
    """A model with a language-modelling head (``generate`` ready)."""

    _task = "causal_lm"


class AutoModelForSequenceClassification(_AutoModel):
    """A model with a sequence-classification head (``num_labels=...`` as a config override)."""

    _task = "sequence_classification"


__all__ = ["AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification", "resolve_config", "MindFormersError"]
