"""User-facing errors.

Every mistake a user can make (a wrong config value, an impossible parallel layout, a missing or damaged
file, a prompt that is too long) raises :class:`MindFormersError` with a one-line message that names the
field, the value and what would be valid. The CLI prints such errors as one line without a traceback;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any, Iterable


class MindFormersError(ValueError):
    """A user error: bad config, bad layout, bad input or a missing/damaged file. One line, no traceback."""


class ConfigError(MindFormersError):
    """A configuration field holds a value that is not allowed."""


class CheckpointError(MindFormersError):
    """A checkpoint folder is missing, incomplete, damaged or does not match the model."""


class MismatchedSizesError(CheckpointError, RuntimeError):
    """A checkpoint's tensor has another shape than the model's (and ``ignore_mismatched_sizes`` is off). Also a
    ``RuntimeError``: transformers raises that there, and code written for it catches that."""


def _fmt_choices(choices: Iterable[Any]) -> str:
    return ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)


def invalid_choice(field: str, value: Any, choices: Iterable[Any]) -> ConfigError:
    """Build the standard error for ``field=value`` not among ``choices``."""
    return ConfigError(f"{field}={value!r} is not valid; choose one of: {_fmt_choices(choices)}")


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise :func:`invalid_choice` unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise invalid_choice(field, value, choices)
