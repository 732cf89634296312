"""A KV cache that preallocates its tensors once and fills them by slicing.

transformers' ``DynamicCache`` concatenates at every step (a copy of the whole cache per token) and its
``StaticCache`` writes with ``index_copy_`` and hands the layers the *full* preallocated buffer, so every step
needs a mask hiding the unwritten slots and a tensor-to-int sync for the cache length. Here the filled length is
a Python int, writes are slice assignments, and ``update`` returns views of only the filled part: an unpadded
decode step needs no mask at all (SDPA sees exactly the past and the new keys).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import MindFormersError


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers of shape (B, n_kv_heads, max_cache_len, head_dim).

    The buffers are allocated at the first ``update`` (so batch size, heads, dtype and device come from the model,
    whatever tensor-parallel sharding it has).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, max_cache_len: int) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.length = 0
        self.slot: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the buffers with the batch size, heads, dtype and device of the first keys/values."""
        b, h, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(b, h, self.max_cache_len, dk)
        self.values = value_states.new_empty(b, h, self.max_cache_len, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new (B, nkv, T, hs) keys/values after the cached ones; return views of everything cached. In
        slot mode (:meth:`StaticKVCache.write_at`) write them at the slot and return the whole buffers."""
        if self.slot is not None:
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        if end > self.max_cache_len:
            raise MindFormersError(
                f"the KV cache holds max_cache_len={self.max_cache_len} tokens but {end} were written; "
                "allocate it with a larger max_cache_len"
            )
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Keys seen by the next forward: the cached ones plus the new ones, starting at position 0 (in slot mode
        the whole buffers)."""
        if self.slot is not None:
            return self.max_cache_len, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Number of cached tokens (a Python int: reading it never waits on the device); in slot mode the capacity
        (the fill then lives on the device, and compiled code must not specialise on it)."""
        return self.max_cache_len if self.slot is not None else self.length

    def get_max_length(self) -> int:
        """Capacity of the buffers in tokens."""
        return self.max_cache_len

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are kept for reuse) and leave slot mode."""
        self.length = 0
        self.slot = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise MindFormersError(
                f"crop(tokens_to_remove={tokens_to_remove}) must be given a negative count of tokens to drop"
            )
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows (beam search)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times."""
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``."""
        if self.is_initialized:
            self.keys = self.keys[indices]
            self.values = self.values[indices]


class StaticKVCache(Cache):
    """A transformers ``Cache`` of :class:`PreallocatedLayer`, one per decoder layer.

    Usable wherever a ``Cache`` is: ``model(ids, past_key_values=StaticKVCache(n_layers, 128))`` or
    ``model.generate(ids, past_key_values=StaticKVCache(n_layers, max_length))``.

    Args:
        num_layers: number of decoder layers of the model.
        max_cache_len: most tokens (prompt + generated) the cache will hold.
    """

    def __init__(self, num_layers: int, max_cache_len: int) -> None:
        super().__init__(layers=[PreallocatedLayer(max_cache_len) for _ in range(num_layers)])

    # The generic Cache methods below also handle offloading, lazily added layers and linear-attention layers, none of
    # which this cache has; going straight to the layer saves that bookkeeping on every layer of every decode step.

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer_idx``'s new keys/values; return views of all its cached keys/values."""
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens cached in layer ``layer_idx`` (its capacity in slot mode, see :meth:`write_at`)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def write_at(self, slot: torch.Tensor) -> None:
        """Slot mode, for a decode step of fixed shapes (a CUDA graph): from now on every layer writes one token's
        keys and values at the position held in ``slot`` (a one-element long tensor on the cache's device, updated
        by the caller between steps) and returns its whole buffers, which the caller masks (the unwritten slots
        hold zeros: attention multiplies every key, and a NaN among the masked ones would poison the row). The
        buffers must exist (a prompt was written)."""
        for layer in self.layers:
            if not layer.is_initialized:
                raise MindFormersError("write_at needs the cache's buffers: write the prompt first")
            layer.keys[:, :, layer.length:].zero_()
            layer.values[:, :, layer.length:].zero_()
            layer.slot = slot

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(keys seen by the next forward, position of the first key) for layer ``layer_idx``."""
        return self.layers[layer_idx].get_mask_sizes(query_length)
