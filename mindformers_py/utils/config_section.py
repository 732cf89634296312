"""Machinery shared by the dataclass config sections (parallel layout, recompute, MoE routing): the
:class:`_Section` base and value converters.

:class:`_Section` gives every dataclass section (:mod:`mindformers_py.parallel.config`, the MoE section of model
configs in :mod:`mindformers_py.layers.moe.config`) its dict/CLI construction, ``to_dict`` and overrides; the
``_to_*`` converters turn raw values (YAML scalars, CLI strings) into field values and raise one-line ConfigErrors
naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError, invalid_choice

_TRUE_STRINGS = ("true", "yes", "on", "1")
_FALSE_STRINGS = ("false", "no", "off", "0")

# MindFormers keys that are deliberately absent, with the reason shown when a YAML uses one.
_UNSUPPORTED_KEYS = {
    "parallel_optimizer_comm_recompute": "optimizer_shard=3 already re-gathers parameters in backward (FSDP2)",
    "mp_comm_recompute": "torch checkpointing re-runs the tensor-parallel collectives inside a recomputed block",
    "recompute_slice_activation": "it tunes a MindSpore graph pass with no torch counterpart",
    "select_comm_recompute": "it tunes a MindSpore graph pass with no torch counterpart",
    "gradient_aggregation_group": "gradient bucketing is left to torch.distributed",
}


# ---------------------------------------------------------------------------------------------------------------
# Conversion of raw values (YAML scalars, CLI strings) to field values. Each raises a one-line ConfigError.
# ---------------------------------------------------------------------------------------------------------------


def _to_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; accepts ints and their decimal strings, never bools."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} is not valid; expected an integer >= {minimum}")
    return value


def _require_int(name: str, value: Any, minimum: int = 1) -> None:
    """Refuse anything but an int >= ``minimum`` (validate() after construction: no conversion)."""
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{name}={value!r} is not valid; expected an integer >= {minimum}")


def _to_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; accepts bools, 0/1 and the strings true/false/yes/no/on/off."""
    if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS + _FALSE_STRINGS:
        return value.strip().lower() in _TRUE_STRINGS
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{name}={value!r} is not valid; expected true or false")


def _to_float(name: str, value: Any, minimum: float, inclusive: bool) -> float:
    """``value`` as a float above (or at, if ``inclusive``) ``minimum``; accepts numbers and numeric strings."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise ConfigError(f"{name}={value!r} is not valid; expected a number {bound} {minimum}")
    return float(value)


def _to_choice(name: str, value: Any, choices: tuple[str, ...], aliases: Mapping[str, str] | None = None) -> str:
    """``value`` as one of ``choices``, compared case-insensitively, after resolving ``aliases``."""
    if isinstance(value, str):
        key = value.strip().lower()
        key = (aliases or {}).get(key, key)
        if key in choices:
            return key
    raise invalid_choice(name, value, choices)


def _split_list(value: Any) -> Any:
    """A CLI string ``"a,b"`` as ``["a", "b"]``; other values unchanged."""
    if isinstance(value, str) and "," in value:
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@contextlib.contextmanager
def _prefixed(prefix: str) -> Iterator[None]:
    """Re-raise ConfigErrors from a nested section with its path (messages start with the field name)."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{prefix}.{err}") from None


_S = TypeVar("_S", bound="_Section")

# ---------------------------------------------------------------------------------------------------------------
# Shared behaviour of the config sections.
# ---------------------------------------------------------------------------------------------------------------


class _Section:
    """Dict/CLI construction, ``to_dict`` and overrides shared by the dataclass config sections.

    Subclasses convert raw values in ``_convert`` and check the result in ``validate``; ``__post_init__`` runs
    both, so an instance that exists is valid. Call ``validate()`` again after assigning fields by hand.
    """

    _SUBSECTIONS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self._convert()
        self.validate()

    def _convert(self) -> None:
        """Turn raw values (strings, shorthands) into field values in place."""

    def validate(self) -> None:
        """Check every field and the relations between fields; raise a one-line ConfigError on the first fault."""

    @classmethod
    def field_names(cls) -> list[str]:
        """The keys :meth:`from_dict` accepts, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def _unknown_key(cls, key: Any) -> ConfigError:
        reason = _UNSUPPORTED_KEYS.get(key)
        what = f"is not supported ({reason})" if reason else f"is not a {cls.__name__} field"
        return ConfigError(f"{key} {what}; valid fields: {', '.join(cls.field_names())}")

    @classmethod
    def from_dict(cls: type[_S], data: Mapping[str, Any] | None) -> _S:
        """Build from a YAML section or a dict of CLI strings; unknown keys are refused, missing ones default."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__} section={data!r} is not valid; expected a mapping of field: value")
        for key in data:
            if key not in cls.field_names():
                raise cls._unknown_key(key)
        return cls(**data)

    @classmethod
    def coerce(cls: type[_S], value: Any, name: str) -> _S:
        """``value`` as an instance: an instance (copied), a mapping (:meth:`from_dict`) or None (defaults)."""
        if isinstance(value, cls):
            return dataclasses.replace(value)
        if value is None or isinstance(value, Mapping):
            with _prefixed(name):
                return cls.from_dict(value)
        raise ConfigError(f"{name}={value!r} is not valid; expected a {cls.__name__} or a mapping of its fields")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (nested sections as dicts, sequences as lists): YAML-serialisable and
        accepted back by :meth:`from_dict`."""
        out: dict[str, Any] = {}
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, _Section):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    def with_overrides(self: _S, overrides: Mapping[str, Any]) -> _S:
        """A copy with ``overrides`` applied (CLI flags). ``section.field`` keys change one field of a nested
        section; a plain key for a section replaces the whole section (``recompute="selective"``)."""
        flat: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for key, value in overrides.items():
            head, dot, rest = str(key).partition(".")
            if head not in self.field_names():
                raise self._unknown_key(key)
            if dot and head not in self._SUBSECTIONS:
                raise ConfigError(f"{key} is not valid; {head} has no sub-fields")
            if dot:
                nested.setdefault(head, {})[rest] = value
            else:
                flat[head] = value
        result = self.from_dict({**self.to_dict(), **flat})
        for head, sub in nested.items():
            with _prefixed(head):
                section = getattr(result, head).with_overrides(sub)
            result = dataclasses.replace(result, **{head: section})
        return result
