"""Re-exports that import their module on first use (PEP 562), so importing a package costs only what is used.

``from mindformers_py import Trainer`` imports the trainer, ``import mindformers_py`` imports nothing heavy: torch,
transformers' modeling code and the model families load when a name that needs them is first read.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any],
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a public name to the module that
    defines it (relative to ``package``, e.g. ``".auto"``, or absolute, e.g. ``"transformers"``). A name read once is
    stored in ``namespace`` (the package's ``globals()``), so later reads are plain attribute reads. Submodules
    (``mindformers_py.trainer``) are imported on first read too, as the eager package did."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    shadowed = {name for name, module in exports.items() if module.rsplit(".", 1)[-1] == name}
    if shadowed:
        _keep_exports_over_submodules(sys.modules[package], shadowed)
    return __getattr__, __dir__


def _keep_exports_over_submodules(module: types.ModuleType, names: set[str]) -> None:
    """A public name that is also its submodule's name (``parallel.parallelize``, the function, defined in
    ``parallel/parallelize.py``): when anything imports that submodule, Python sets the package's attribute to the
    submodule, and from then on ``from mindformers_py.parallel import parallelize`` gives the module, not the function
    (whether it does would depend on what was imported before). The package keeps the exported object instead; the
    submodule itself stays in ``sys.modules`` for ``from .parallelize import ...``."""

    class _Package(type(module)):  # type: ignore[misc]
        def __setattr__(self, name: str, value: Any) -> None:
            if name in names and isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
                value = getattr(value, name)
            super().__setattr__(name, value)

    module.__class__ = _Package
