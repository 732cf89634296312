"""The table of model families: which config, model classes, presets and HF architectures each one covers.

``mindformers_py.auto``, checkpoint consolidation and the ``auto_parallel`` planner read this table; a new family adds
one :class:`Family` entry and nothing else changes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from ..task_registry import get_task
from .lazy_registration import BUILTIN_CONFIGS, CHECKPOINT_LOADER, Deferred, load_builtin_families, register_deferred_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

BASE = "base"
"""Key of a family's bare model (hidden states) in :attr:`Family.model_classes`; the others are task names of
:mod:`mindformers_py.task_registry`."""


class ModelClasses(Mapping[str, "type[PreTrainedModel]"]):
    """A family's model classes by key, imported from ``module`` on first read of one: a family's package imports
    its config and presets, not its modeling code (transformers' modeling module costs more than torch), so
    ``plan``, presets and config checks stay fast. Keys, ``in`` and ``len`` import nothing."""

    def __init__(self, module: str, names: Mapping[str, str]) -> None:
        self.module, self.names = module, dict(names)

    def __getitem__(self, key: str) -> type[PreTrainedModel]:
        return getattr(importlib.import_module(self.module), self.names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def deferred(self, key: str) -> Deferred:
        return Deferred(self.module, self.names[key])


@dataclass
class Family:
    """One model family (GPT, BERT, T5, ...)."""

    name: str
    """Short family name shown by ``show_support_list``."""
    config_class: type[PretrainedConfig]
    """Our config class (its ``model_type`` identifies our checkpoints)."""
    model_classes: Mapping[str, type[PreTrainedModel]]
    """``"base"`` or a task registry name (``"causal_lm"``, ...) -> model class (a :class:`ModelClasses` imports
    them when read)."""
    presets: dict[str, dict]
    """Preset name -> config kwargs."""
    converter: ModuleType | None = None
    """Module with ``SUPPORTED_HF_TYPES``, ``config_from_hf``, ``state_dict_from_hf``, ``config_to_hf``,
    ``state_dict_to_hf``, ``hf_type_for`` for HF interop."""
    hf_model_classes: dict[str, Callable[[str], str | None]] = field(default_factory=dict)
    """``"base"`` or task name -> function of the HF model_type giving the transformers class name to export as."""
    extra_model_classes: Mapping[str, type[PreTrainedModel]] = field(default_factory=dict)
    """Model classes beyond the tasks', by the name of the transformers Auto class that loads them (T5's encoder
    alone: ``{"AutoModelForTextEncoding": T5EncoderModel}``), registered with that transformers Auto class and
    loaded by ours of the same name; or, for a class transformers has no Auto class for, by its own name
    (``GPTDoubleHeadsModel``), loaded by its ``from_pretrained``. ``convert_checkpoint`` finds them by the
    ``architectures`` of a checkpoint."""
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


_FAMILIES: list[Family] = []
"""Families registered so far; read it as ``FAMILIES``, which first imports the built-in ones."""


def families() -> list[Family]:
    """Every family, the built-in ones imported first. ``import mindformers_py`` imports no family (each costs torch
    and transformers' modeling code), so the table fills on first read; ``registry.FAMILIES`` is this list too."""
    load_builtin_families()
    return _FAMILIES


def _builtin_rank(family: Family) -> int:
    """The position of ``family``'s package in the built-in table; after all of them for a user's family."""
    packages = [package + "." for package, _ in BUILTIN_CONFIGS.values()]
    module = family.config_class.__module__
    return next((i for i, package in enumerate(packages) if module.startswith(package)), len(packages))


def __getattr__(name: str) -> list[Family]:
    if name == "FAMILIES":
        return families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checkpoint_loader() -> Callable | None:
    """How a model class of ours loads a checkpoint it does not hold itself (a preset, an HF checkpoint):
    :data:`~mindformers_py.models.lazy_registration.CHECKPOINT_LOADER`, imported on first use."""
    loader = CHECKPOINT_LOADER[0]
    if isinstance(loader, Deferred):
        loader = CHECKPOINT_LOADER[0] = loader.load()
    return loader


def register_family(family: Family) -> None:
    """Add ``family`` to the table and register its classes with transformers' Auto classes and class-name tables
    (transformers' Trainer and pipelines decide what a model is from those: label smoothing shifts the labels of
    the models listed as causal LMs), and with peft's defaults when peft is loaded."""
    import transformers

    _FAMILIES.append(family)
    # In the built-in table's order whatever order their packages were imported in (error messages list presets and
    # model types from here: the same text in every process), families registered by users after them (stable).
    _FAMILIES.sort(key=_builtin_rank)
    model_type = family.config_class.model_type
    transformers.AutoConfig.register(model_type, family.config_class, exist_ok=True)
    for task in family.model_classes:
        auto_name = "AutoModel" if task == BASE else get_task(task).auto_class
        register_model_class(getattr(transformers, auto_name), family.config_class, family.model_classes, task)
    for auto_name in family.extra_model_classes:
        auto = getattr(transformers, auto_name, None) if auto_name.startswith("Auto") else None
        if auto is None:  # a class with no Auto class of transformers (GPT-2's double-heads model)
            continue
        register_model_class(auto, family.config_class, family.extra_model_classes, auto_name)
    register_with_peft()


def register_model_class(auto_class: type, config_class: type[PretrainedConfig],
                         classes: Mapping[str, type[PreTrainedModel]], key: str) -> None:
    """Register ``classes[key]`` for ``config_class`` with the transformers Auto class ``auto_class`` (without
    importing it when ``classes`` is a :class:`ModelClasses`), and in the class-name table behind it
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ...)."""
    if isinstance(classes, ModelClasses):
        register_deferred_model(auto_class, config_class, classes.deferred(key))
    else:
        auto_class.register(config_class, classes[key], exist_ok=True)
    names = getattr(getattr(auto_class, "_model_mapping", None), "_model_mapping", None)
    if isinstance(names, dict):
        names.setdefault(config_class.model_type, _class_name(classes, key))


def _class_name(classes: Mapping[str, type[PreTrainedModel]], key: str) -> str:
    """The name of ``classes[key]``, without importing it when ``classes`` is a :class:`ModelClasses`."""
    return classes.names[key] if isinstance(classes, ModelClasses) else classes[key].__name__


def register_with_peft() -> None:
    """Give our model types peft's defaults of their reference type (``Family.peft_reference``), so LoRA and the
    other adapters work without ``target_modules``, as for Llama. Only when peft is loaded (it is optional); our
    models call this again when they are built, which covers peft imported after this package."""
    constants = sys.modules.get("peft.utils.constants")
    if constants is None:
        return
    for family in _FAMILIES:
        for name, table in vars(constants).items():
            if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and family.peft_reference in table:
                table.setdefault(family.config_class.model_type, table[family.peft_reference])


def family_for_model_type(model_type: str) -> Family | None:
    """The family whose own or HF ``model_type`` this is."""
    for family in families():
        if model_type == family.config_class.model_type or model_type in family.hf_types:
            return family
    return None


def family_for_preset(name: str) -> Family | None:
    """The family that defines the preset ``name``."""
    return next((f for f in families() if name in f.presets), None)


def is_preset(name: str) -> bool:
    """Whether ``name`` is a preset of some family."""
    return family_for_preset(name) is not None


def model_class_named(name: str) -> type[PreTrainedModel] | None:
    """Our model class called ``name`` (a ``config.json``'s ``architectures`` entry), among every family's classes;
    None when no family has one."""
    for family in families():
        for classes in (family.model_classes, family.extra_model_classes):
            for key in classes:
                if _class_name(classes, key) == name:
                    return classes[key]  # imports only this class's module
    return None


def hf_export(config: PretrainedConfig) -> dict:
    """The ``config.json`` dict of the transformers config ``config`` converts to (its family's ``config_to_hf``):
    a family's :attr:`Family.planner_config` when its models have the shape of their HF export."""
    family = family_for_model_type(config.model_type)
    return family.converter.config_to_hf(config).to_dict()


def all_presets() -> list[str]:
    return [p for f in families() for p in f.presets]


def all_model_types() -> list[str]:
    return [t for f in families() for t in (f.config_class.model_type, *f.hf_types)]
