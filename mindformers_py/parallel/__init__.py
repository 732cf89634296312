"""Parallel training on torch.distributed: configuration (more engines are added beside it)."""

from .config import MoEConfig, ParallelConfig, RecomputeConfig

__all__ = ["MoEConfig", "ParallelConfig", "RecomputeConfig"]
