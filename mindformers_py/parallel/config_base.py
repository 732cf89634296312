"""The config-section machinery moved to :mod:`mindformers_py.utils.config_section` (model configs use it too: the
MoE section of a model config is validated by it, and models may not import ``parallel``); re-exported here so
existing imports keep working."""

from ..utils.config_section import (  # noqa: F401
    _FALSE_STRINGS,
    _TRUE_STRINGS,
    _UNSUPPORTED_KEYS,
    _divisors,
    _prefixed,
    _require_int,
    _Section,
    _split_list,
    _to_bool,
    _to_choice,
    _to_float,
    _to_int,
)
