"""Generation: a preallocated KV cache and a lean decode loop behind transformers' ``generate`` API."""

from .fast_generate import FastGenerationMixin, check_context_length, position_limit
from .static_cache import PreallocatedLayer, StaticKVCache

__all__ = ["FastGenerationMixin", "check_context_length", "position_limit", "PreallocatedLayer", "StaticKVCache"]
