"""The training runtime behind the Trainer: the :class:`Engine` seam and its distributed and pipeline engines.

An engine owns what a parallel layout changes in training (device placement and wrapping of the model, the
optimizer, mixed precision, one step's forward and backward, gradient clipping, the data shard of a rank, metric
reduction, checkpoint files and RNG states) and the one path that normalises the loss for every layout
(:mod:`.step_loss`); the mechanisms it applies (mesh, tensor / data / pipeline parallelism, recompute) live in
:mod:`mindformers_py.parallel`, the checkpoint files it writes and reads in :mod:`mindformers_py.checkpoint`, the
``auto_parallel`` planner in :mod:`mindformers_py.planner`. Which engine serves which ``parallel_mode`` is one table
in :mod:`.registry`.
"""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    "EngineArguments": ".args",
    "Engine": ".base",
    **dict.fromkeys(["LossFn", "StepLoss", "TrainingLoss"], ".step_loss"),
    "DistributedEngine": ".distributed",
    "PipeliningEngine": ".pipelining_engine",
    **dict.fromkeys(["build_engine", "current_world_size", "plan_layout", "register_engine", "resolve_layout"], ".registry"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
