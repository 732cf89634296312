"""Parallel training on torch.distributed: configuration, mesh, layouts and the distributed training engine."""

from .config import MoEConfig, ParallelConfig, RecomputeConfig
from .distributed_engine import DistributedEngine  # registers the engine for data_parallel / semi_auto_parallel
from .pipeline_engine import PipelineEngine  # registers it for semi_auto_parallel layouts with pipeline stages
from .mesh import ParallelMesh, build_mesh
from .parallelize import parallelize

__all__ = ["DistributedEngine", "MoEConfig", "ParallelConfig", "ParallelMesh", "PipelineEngine", "RecomputeConfig",
           "build_mesh", "parallelize"]
