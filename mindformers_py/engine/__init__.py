"""The training runtime behind the Trainer: the :class:`Engine` seam and its distributed and pipeline engines.

An engine owns what a parallel layout changes in training (device placement and wrapping of the model, the
optimizer, mixed precision, one step's forward and backward, gradient clipping, the data shard of a rank, metric
reduction, checkpoint files and RNG states); the mechanisms it applies (mesh, tensor / data / pipeline
parallelism, recompute, resharding checkpoints, the planner) live in :mod:`mindformers_py.parallel`.
Which engine serves which ``parallel_mode`` is one table in :mod:`.registry`.
"""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    "EngineArguments": ".args",
    **dict.fromkeys(["Engine", "LossFn"], ".base"),
    "DistributedEngine": ".distributed",
    "PipelineEngine": ".pipeline_engine",
    **dict.fromkeys(["build_engine", "current_world_size", "register_engine"], ".registry"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
