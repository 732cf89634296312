"""Re-exports that import their module on first use (PEP 562), so importing a package costs only what is used.

``from mindformers_py import Trainer`` imports the trainer, ``import mindformers_py`` imports nothing heavy: torch,
transformers' modeling code and the model families load when a name that needs them is first read.
"""

from __future__ import annotations

import importlib
import importlib.util
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

    return __getattr__, __dir__
