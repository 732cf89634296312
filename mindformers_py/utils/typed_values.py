"""Values read by the field's type: strings from YAML files and command-line flags become the type a field
declares (``"no"`` is a string for a string field and False for a boolean one), and non-strings are checked
against it. Every refusal is a one-line ConfigError naming the field."""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, Mapping

from ..errors import ConfigError

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_NONE = ("none", "null", "")


def coerce_value(name: str, value: Any, hint: Any) -> Any:
    """``value`` converted to the type ``hint`` allows when it is a string (YAML/CLI); type-checked otherwise."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    plain = [typing.get_origin(t) or t for t in allowed]
    if value is None:
        if type(None) in plain:
            return None
        raise ConfigError(f"{name}=None is not valid; expected {_describe(plain)}")
    if isinstance(value, str):
        text = value.strip()
        if type(None) in plain and text.lower() in _NONE:
            return None
        if bool in plain and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if int in plain:
            try:
                return int(text)
            except ValueError:
                pass
        if float in plain:
            try:
                return float(text)
            except ValueError:
                pass
        if list in plain:
            return [part.strip() for part in text.split(",") if part.strip()]
        if dict in plain:
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                return parsed
        if str in plain:
            return value
        raise ConfigError(f"{name}={value!r} is not valid; expected {_describe(plain)}")
    for t in plain:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value if int in plain and isinstance(value, int) else float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t in (str, list, dict) and isinstance(value, t):
            return value
        if t is list and isinstance(value, tuple):
            return list(value)
    raise ConfigError(f"{name}={value!r} is not valid; expected {_describe(plain)}")


def _describe(types: list[Any]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "none"}
    return " or ".join(names.get(t, getattr(t, "__name__", str(t))) for t in types)


def field_types(cls: type) -> dict[str, Any]:
    """The annotated field types of ``cls`` and its bases, resolved one by one (``typing.get_type_hints`` gives up
    on a whole class when any base has an annotation it cannot resolve, as transformers' configs have)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        namespace = vars(sys.modules.get(klass.__module__, typing))
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, dict(namespace))  # noqa: S307 - a class's own annotation text
                except Exception:  # noqa: BLE001 - names only known under TYPE_CHECKING: not convertible
                    continue
            out[name] = annotation
    return out


def coerce_fields(cls: type, values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` with each string converted by the type annotation of the same-named field of ``cls`` (a dataclass
    or an annotated class such as a ``PretrainedConfig``); keys without a usable annotation pass unchanged."""
    hints = field_types(cls)
    out = dict(values)
    for key, value in values.items():
        hint = hints.get(key)
        if isinstance(value, str) and hint is not None and typing.get_origin(hint) is not typing.ClassVar:
            out[key] = coerce_value(f"{prefix}{key}", value, hint)
    return out
