"""Parallel training on torch.distributed: configuration, mesh, layouts and the distributed training engine."""

from .config import MoEConfig, ParallelConfig, RecomputeConfig
from .distributed_engine import DistributedEngine  # registers the engine for data_parallel / semi_auto_parallel
from .mesh import ParallelMesh, build_mesh
from .parallelize import parallelize

__all__ = ["DistributedEngine", "MoEConfig", "ParallelConfig", "ParallelMesh", "RecomputeConfig", "build_mesh",
           "parallelize"]
