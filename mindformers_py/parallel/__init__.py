"""Parallel mechanisms on torch.distributed: configuration, mesh, tensor / data / pipeline parallelism, recompute,
resharding checkpoints and the launcher. The offline planner is :mod:`mindformers_py.planner`. The engines that train with them are in
:mod:`mindformers_py.engine`."""

from .config import MoEConfig, ParallelConfig, RecomputeConfig
from .mesh import ParallelMesh, build_mesh
from .parallelize import parallelize

__all__ = ["MoEConfig", "ParallelConfig", "ParallelMesh", "RecomputeConfig", "build_mesh", "parallelize"]
