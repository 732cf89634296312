"""Generation: a preallocated KV cache and a lean decode loop behind transformers' ``generate`` API."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["FastGenerationMixin", "check_context_length", "position_limit"], ".fast_generate"),
    **dict.fromkeys(["PreallocatedLayer", "StaticKVCache"], ".static_cache"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
