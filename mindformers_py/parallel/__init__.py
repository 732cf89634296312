"""Parallel mechanisms on torch.distributed: configuration, mesh, tensor / data / expert parallelism and recompute
here; context parallelism in :mod:`.context`, pipeline parallelism in :mod:`.pipelining`. The offline planner is
:mod:`mindformers_py.planner`, the process launcher :mod:`mindformers_py.launcher`, resharding (DCP) checkpoints
:mod:`mindformers_py.checkpoint.sharded`. The engines that train with them are in :mod:`mindformers_py.engine`."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["MoEConfig", "ParallelConfig", "RecomputeConfig"], ".config"),
    **dict.fromkeys(["ParallelMesh", "build_mesh"], ".mesh"),
    "Layout": ".layout",
    "parallelize": ".parallelize",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
