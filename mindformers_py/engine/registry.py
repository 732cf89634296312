"""Which engine serves which ``parallel_mode``: the one table, and :func:`build_engine` that reads it.

=====================  ====================================================================================
``parallel_mode``      engine
=====================  ====================================================================================
``stand_alone``        :class:`~.base.Engine` (one process)
``data_parallel``      :class:`~.distributed.DistributedEngine` (replicas, ZeRO per ``optimizer_shard``)
``semi_auto_parallel`` :class:`~.pipeline_engine.PipelineEngine` with pipeline stages, else ``DistributedEngine``
``auto_parallel``      the planner turns the hints into a fixed layout for this run's processes
                       (:func:`plan_layout`), then the engine of that layout
=====================  ====================================================================================

:func:`register_engine` replaces an entry (a custom engine for a mode); nothing registers itself on import.
:func:`plan_layout` is the one caller of the ``auto_parallel`` planner: the recipe runner (planning before it
launches the workers) and this table (a Trainer given an ``auto_parallel`` config) both go through it.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch.distributed as dist

from ..errors import ConfigError
from ..parallel.config import ParallelConfig
from .args import EngineArguments
from .base import Engine
from .distributed import DistributedEngine
from .pipeline_engine import PipelineEngine

EngineFactory = Callable[..., Engine]
"""``factory(parallel_config, args, **context) -> Engine``; ``context`` carries ``model_config`` and
``seq_length`` (what the ``auto_parallel`` planner needs) and may be ignored."""


def _semi_auto_engine(parallel_config: ParallelConfig, args: EngineArguments, **context: Any) -> Engine:
    """The pipeline engine for layouts with pipeline stages, the distributed engine for the others."""
    return (PipelineEngine if parallel_config.pp > 1 else DistributedEngine)(parallel_config, args)


def _data_parallel_engine(parallel_config: ParallelConfig, args: EngineArguments, **context: Any) -> Engine:
    return DistributedEngine(parallel_config, args)


def _stand_alone_engine(parallel_config: ParallelConfig, args: EngineArguments, **context: Any) -> Engine:
    return Engine(parallel_config, args)


def current_world_size() -> int:
    """Processes of this run: the joined process group's size, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_layout(parallel_config: ParallelConfig, model_config: Any, world_size: int, per_device_batch: int,
                seq_length: int | None = None, summary: list[str] | None = None,
                trainable_params: int | None = None) -> ParallelConfig:
    """The layout an ``auto_parallel`` config runs with on ``world_size`` processes for ``model_config``
    (:func:`~mindformers_py.planner.search.auto_parallel`: the fastest that fits, logged as a table; under a
    running process group every rank gets rank 0's plan; the rank that planned appends the plan's one-line reason to
    ``summary``); other modes are returned unchanged. ``trainable_params`` is a peft adapter's count (gradients and
    optimizer state for those alone). A plan for one process is a ``stand_alone`` layout (no process group to join:
    what an ``auto_parallel`` run on a machine without GPUs and without size hints gets)."""
    if parallel_config.parallel_mode != "auto_parallel":
        return parallel_config
    from ..planner.search import auto_parallel

    layout = auto_parallel(parallel_config, model_config, world_size, per_device_batch, seq_length, summary=summary,
                           trainable_params=trainable_params)
    if world_size == 1:
        layout = ParallelConfig.from_dict({**layout.to_dict(), "parallel_mode": "stand_alone"})
    return layout


def local_world_size(parallel_config: ParallelConfig) -> int:
    """Processes an ``auto_parallel`` run started on this machine without torchrun plans for (the Trainer's own
    workers): every visible GPU, else the product of the config's size hints
    (:func:`~mindformers_py.planner.search.default_world_size`)."""
    from ..planner.search import default_world_size

    return default_world_size(parallel_config)


def _planned_engine(parallel_config: ParallelConfig, args: EngineArguments, *, model_config: Any = None,
                    seq_length: int | None = None, **context: Any) -> Engine:
    """``auto_parallel``: plan a layout for this run's processes and the model (:func:`plan_layout`), then build
    its engine. One process plans for one process (the layout sizes in the config are hints)."""
    if model_config is None:
        raise ConfigError("parallel_mode='auto_parallel' needs the model's config to plan a layout; pass the model "
                          "to the Trainer (or model_config= to build_engine)")
    world = current_world_size()
    summary: list[str] = []
    layout = plan_layout(parallel_config, model_config, world, args.per_device_train_batch_size, seq_length,
                         summary=summary)
    engine = build_engine(layout, args)  # (a one-process plan is stand-alone: no process group)
    engine.plan_summary = summary[0] if summary else None  # rank 0's reason, for the run's layout line
    return engine


_ENGINES: dict[str, EngineFactory] = {
    "stand_alone": _stand_alone_engine,
    "data_parallel": _data_parallel_engine,
    "semi_auto_parallel": _semi_auto_engine,
    "auto_parallel": _planned_engine,
}


def register_engine(parallel_mode: str, factory: EngineFactory) -> None:
    """Make ``factory(parallel_config, args, **context)`` the engine for ``parallel_mode`` (replacing the
    built-in one). A factory (or class) taking only ``(parallel_config, args)`` is called without the context."""
    _ENGINES[parallel_mode] = factory


def build_engine(parallel_config: ParallelConfig, args: EngineArguments, *, model_config: Any = None,
                 seq_length: int | None = None) -> Engine:
    """The engine for ``parallel_config.parallel_mode`` (not yet set up: call :meth:`Engine.setup`).

    ``model_config`` and ``seq_length`` let ``auto_parallel`` plan before any process group exists."""
    mode = parallel_config.parallel_mode
    if mode not in _ENGINES:
        raise ConfigError(f"parallel_mode={mode!r} has no training engine; choose one of: "
                          f"{', '.join(repr(m) for m in _ENGINES)}")
    factory = _ENGINES[mode]
    if _takes_context(factory):
        return factory(parallel_config, args, model_config=model_config, seq_length=seq_length)
    return factory(parallel_config, args)


def _takes_context(factory: EngineFactory) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD or p.name == "model_config" for p in params)
