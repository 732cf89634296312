"""Loading weights at real size: lazily read checkpoints, models built on ``meta`` and filled tensor by tensor (or
shard by shard), streamed saving. See :mod:`.deferred` for the model side, :mod:`.conversion_trace` for the
checkpoint side (the files themselves are read by :mod:`mindformers_py.checkpoint.reader`)."""

from .deferred import deferred_loading, materialize

__all__ = ["deferred_loading", "materialize"]
