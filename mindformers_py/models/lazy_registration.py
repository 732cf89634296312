"""Our model types in transformers' Auto classes, at no import cost until a model is used.

transformers registers its own models by name and imports one when it is looked up; ours work the same way:

* ``import mindformers_py`` imports neither torch nor transformers (``mindformers-py --help`` and a one-line config
  error should not wait seconds). It calls :func:`install`, which adds our ``model_type`` names to transformers'
  config table (``CONFIG_MAPPING``) as :class:`Deferred` entries: now if transformers' Auto module is loaded, else
  by an import hook the moment it loads (importing nothing itself). The first lookup of one (``AutoConfig``, and
  so every ``transformers.AutoModel*.from_pretrained`` of a folder we saved) imports the family's package.
* A family's package imports its config, presets and converter, not its modeling code (transformers' modeling
  module costs more than torch): :func:`~mindformers_py.models.registry.register_family` registers each model
  class with its transformers Auto class as a :class:`Deferred` entry (:func:`register_deferred_model`), imported
  when transformers looks the config up (``from_pretrained``, ``from_config``) or our code reads it.

transformers keeps registered classes in each mapping's ``_extra_content`` dict; :func:`deferred_table` makes that
dict resolve :class:`Deferred` values on read (``tests/models/test_lazy_registration.py`` keeps it working).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

BUILTIN_CONFIGS: dict[str, tuple[str, str]] = {
    "mindformers_gpt": ("mindformers_py.models.gpt", "GPTConfig"),
    "mindformers_bert": ("mindformers_py.models.bert", "BertConfig"),
    "mindformers_t5": ("mindformers_py.models.t5", "T5Config"),
    "mindformers_vit": ("mindformers_py.models.vit", "ViTConfig"),
}
"""Our ``model_type`` -> (the package of its family, its config class): the built-in families. Importing the package
registers the family. ``tests/models/test_lazy_registration.py`` checks this table against the families."""

_CONFIG_AUTO = "transformers.models.auto.configuration_auto"

CHECKPOINT_LOADER: list[Any] = [None]
"""How a model class of ours loads a preset or an HF checkpoint (converting it), as the Auto classes load it: the
package root puts ``Deferred("mindformers_py.auto", "load_model_class")`` here (the Auto classes sit above the models
in the import order, and load with the first such call); read it with
:func:`~mindformers_py.models.registry.checkpoint_loader`."""


def load_builtin_families() -> None:
    """Import every built-in family (each registers itself in :mod:`mindformers_py.models.registry`)."""
    for package, _ in BUILTIN_CONFIGS.values():
        importlib.import_module(package)


class Deferred(NamedTuple):
    """A class not imported yet: ``getattr(import_module(module), name)`` on first read."""

    module: str
    name: str

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


class _DeferredEntries(dict):
    """One of transformers' registration tables (``_extra_content`` of ``CONFIG_MAPPING`` and of each Auto model
    class's mapping: model_type or config class -> class) where a value may still be :class:`Deferred`; reading it
    imports the class and stores it."""

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, Deferred):
            value = value.load()
            self[key] = value
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> list[Any]:  # type: ignore[override]
        return [self[key] for key in self]

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return [(key, self[key]) for key in self]


def deferred_table(mapping: Any) -> _DeferredEntries:
    """``mapping._extra_content`` (transformers' table of registered classes), made able to hold :class:`Deferred`
    values."""
    if not isinstance(mapping._extra_content, _DeferredEntries):
        mapping._extra_content = _DeferredEntries(mapping._extra_content)
    return mapping._extra_content


def register_deferred_model(auto_class: Any, config_class: type, model: Deferred) -> None:
    """``auto_class.register(config_class, <model>)`` without importing the model class: transformers imports it
    the first time it looks ``config_class`` up (``from_pretrained``, ``from_config``)."""
    table = deferred_table(auto_class._model_mapping)
    if not isinstance(dict.get(table, config_class), type):  # a class registered already stays
        dict.__setitem__(table, config_class, model)


def _add_deferred_configs(configuration_auto: ModuleType) -> None:
    table = deferred_table(configuration_auto.CONFIG_MAPPING)
    for model_type, (package, name) in BUILTIN_CONFIGS.items():
        if model_type not in table:
            table[model_type] = Deferred(package, name)


def install() -> None:
    """Make our model types known to transformers' ``AutoConfig`` (and so its Auto model classes): now if its Auto
    module is loaded, else when it loads. Imports neither torch nor transformers."""
    loaded = sys.modules.get(_CONFIG_AUTO)
    if loaded is not None and hasattr(loaded, "CONFIG_MAPPING"):
        _add_deferred_configs(loaded)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_CONFIG_AUTO, _add_deferred_configs))


class _AfterImport:
    """A one-shot import hook (a ``sys.meta_path`` finder): finds module ``name`` with the other finders and runs ``callback(module)`` right after
    the module has executed."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RunAfterLoader(spec.loader, self.callback)
        return spec


class _RunAfterLoader:
    """Delegates to the module's own loader and calls ``callback`` once the module has run; the module keeps its
    own loader afterwards."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ... of the real loader
        return getattr(self.loader, name)
