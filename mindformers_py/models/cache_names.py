"""The key/value cache under both of transformers' names.

transformers 5.24 renamed the cache argument of every model forward, and the cache field of every model output,
from ``past_key_values`` to ``cache``; its ``generate`` now passes ``cache=``. Our forwards keep
``past_key_values`` (what transformers < 5.24 passes, and what most user code writes) and also take ``cache``
(:func:`accepts_cache_argument`); outputs are built with, and read through, whichever field the installed
transformers declares (:data:`CACHE_FIELD`), so neither version sees a deprecation warning from us. A forward that
ignored ``cache=`` would silently decode every new token without its history.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformers.modeling_outputs import BaseModelOutputWithPast

from ..errors import MindFormersError

CACHE_FIELD: str = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
"""The cache field of transformers' model outputs in the installed version."""

CACHE_NAMES: list[str] = ["past_key_values", "cache"]
"""Both names, for lists of output keys to skip (``keys_to_ignore_at_inference``, device placement)."""


def accepts_cache_argument(forward: Callable) -> Callable:
    """Let ``forward`` (whose parameter is ``past_key_values``) also be called with ``cache=``, as
    transformers >= 5.24 calls it."""

    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "cache" in kwargs:
            cache = kwargs.pop("cache")
            if cache is not None and kwargs.get("past_key_values") is not None:
                raise MindFormersError("pass the key/value cache once, as cache= or as past_key_values=, not both")
            if cache is not None or "past_key_values" not in kwargs:
                kwargs["past_key_values"] = cache
        return forward(*args, **kwargs)

    return wrapper


def cache_output(cache: Any) -> dict[str, Any]:
    """``{field: cache}`` for building a transformers model output with the installed version's field name."""
    return {CACHE_FIELD: cache}


def output_cache(output: Any) -> Any:
    """The cache a transformers model output holds (None when it holds none)."""
    return getattr(output, CACHE_FIELD, None)
