"""The table of model families: which config, model classes, presets and HF architectures each one covers.

``mindformers_py.auto``, checkpoint consolidation and the ``auto_parallel`` planner read this table; a new family adds
one :class:`Family` entry and nothing else changes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from transformers import PretrainedConfig, PreTrainedModel

from ..task_registry import get_task

BASE = "base"
"""Key of a family's bare model (hidden states) in :attr:`Family.model_classes`; the others are task names of
:mod:`mindformers_py.task_registry`."""


@dataclass
class Family:
    """One model family (GPT, BERT, T5, ...)."""

    name: str
    """Short family name shown by ``show_support_list``."""
    config_class: type[PretrainedConfig]
    """Our config class (its ``model_type`` identifies our checkpoints)."""
    model_classes: dict[str, type[PreTrainedModel]]
    """``"base"`` or a task registry name (``"causal_lm"``, ...) -> model class."""
    presets: dict[str, dict]
    """Preset name -> config kwargs."""
    converter: ModuleType | None = None
    """Module with ``SUPPORTED_HF_TYPES``, ``config_from_hf``, ``state_dict_from_hf``, ``config_to_hf``,
    ``state_dict_to_hf``, ``hf_type_for`` for HF interop."""
    hf_model_classes: dict[str, Callable[[str], str | None]] = field(default_factory=dict)
    """``"base"`` or task name -> function of the HF model_type giving the transformers class name to export as."""
    extra_model_classes: dict[str, type[PreTrainedModel]] = field(default_factory=dict)
    """Model classes beyond the tasks', by the name of the transformers Auto class that loads them (T5's encoder
    alone: ``{"AutoModelForTextEncoding": T5EncoderModel}``); registered with that transformers Auto class and
    loaded by ours of the same name."""
    peft_reference: str = "llama"
    """The transformers model type whose peft defaults (LoRA target modules, ...) fit this family's module names
    (our layers use Llama's: ``q_proj``, ``v_proj``, ``down_proj``, ...)."""
    planner_config: Callable[[PretrainedConfig], dict] | None = None
    """How the ``auto_parallel`` planner reads the sizes of this family's models: a function of one of its configs
    giving the ``config.json`` dict of the transformers architecture of the same shape (:func:`hf_export`: its HF
    export), which the planner reads; None reads the config field by field, GPT-style (HF field names, a
    ``moe_config`` section)."""

    @property
    def hf_types(self) -> tuple[str, ...]:
        return tuple(self.converter.SUPPORTED_HF_TYPES) if self.converter else ()


FAMILIES: list[Family] = []


def register_family(family: Family) -> None:
    """Add ``family`` to the table and register its classes with transformers' Auto classes and class-name tables
    (transformers' Trainer and pipelines decide what a model is from those: label smoothing shifts the labels of
    the models listed as causal LMs), and with peft's defaults when peft is loaded."""
    import transformers

    FAMILIES.append(family)
    model_type = family.config_class.model_type
    transformers.AutoConfig.register(model_type, family.config_class, exist_ok=True)
    classes = [("AutoModel" if task == BASE else get_task(task).auto_class, cls) for task, cls in family.model_classes.items()]
    for auto_name, cls in classes + list(family.extra_model_classes.items()):
        auto = getattr(transformers, auto_name)
        auto.register(family.config_class, cls, exist_ok=True)
        # The class-name table behind the Auto class (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ...).
        names = getattr(getattr(auto, "_model_mapping", None), "_model_mapping", None)
        if isinstance(names, dict):
            names.setdefault(model_type, cls.__name__)
    register_with_peft()


def register_with_peft() -> None:
    """Give our model types peft's defaults of their reference type (``Family.peft_reference``), so LoRA and the
    other adapters work without ``target_modules``, as for Llama. Only when peft is loaded (it is optional); our
    models call this again when they are built, which covers peft imported after this package."""
    constants = sys.modules.get("peft.utils.constants")
    if constants is None:
        return
    for family in FAMILIES:
        for name, table in vars(constants).items():
            if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and family.peft_reference in table:
                table.setdefault(family.config_class.model_type, table[family.peft_reference])


def family_for_model_type(model_type: str) -> Family | None:
    """The family whose own or HF ``model_type`` this is."""
    for family in FAMILIES:
        if model_type == family.config_class.model_type or model_type in family.hf_types:
            return family
    return None


def family_for_preset(name: str) -> Family | None:
    """The family that defines the preset ``name``."""
    return next((f for f in FAMILIES if name in f.presets), None)


def model_class_named(name: str) -> type[PreTrainedModel] | None:
    """Our model class called ``name`` (a ``config.json``'s ``architectures`` entry), among every family's classes;
    None when no family has one."""
    for family in FAMILIES:
        for cls in (*family.model_classes.values(), *family.extra_model_classes.values()):
            if cls.__name__ == name:
                return cls
    return None


def hf_export(config: PretrainedConfig) -> dict:
    """The ``config.json`` dict of the transformers config ``config`` converts to (its family's ``config_to_hf``):
    a family's :attr:`Family.planner_config` when its models have the shape of their HF export."""
    family = family_for_model_type(config.model_type)
    return family.converter.config_to_hf(config).to_dict()


def all_presets() -> list[str]:
    return [p for f in FAMILIES for p in f.presets]


def all_model_types() -> list[str]:
    return [t for f in FAMILIES for t in (f.config_class.model_type, *f.hf_types)]
