"""Which engine serves which ``parallel_mode``: the one table, and :func:`build_engine` that reads it.

=====================  ====================================================================================
``parallel_mode``      engine
=====================  ====================================================================================
``stand_alone``        :class:`~.base.Engine` (one process)
``data_parallel``      :class:`~.distributed.DistributedEngine` (replicas, ZeRO per ``optimizer_shard``)
``semi_auto_parallel`` :class:`~.pipelining_engine.PipeliningEngine` with pipeline stages, else ``DistributedEngine``
``auto_parallel``      the planner turns the hints into a fixed layout for this run's processes
                       (:func:`plan_layout`), resolved like the others (:func:`resolve_layout`)
=====================  ====================================================================================

:func:`register_engine` replaces an entry (a custom engine for a mode); nothing registers itself on import.
:func:`plan_layout` is the one caller of the ``auto_parallel`` planner: the recipe runner (planning before it
launches the workers) and this table (a Trainer given an ``auto_parallel`` config) both go through it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch.distributed as dist

from ..errors import ConfigError
from ..parallel.config import ParallelConfig
from ..parallel.layout import Layout
from .args import EngineArguments
from .base import Engine
from .distributed import DistributedEngine
from .pipelining_engine import PipeliningEngine

EngineFactory = Callable[..., Engine]
"""``factory(layout, args) -> Engine``: ``layout`` is the run's resolved :class:`~mindformers_py.parallel.layout.Layout`
(an ``auto_parallel`` config is planned and resolved before the table is read)."""


def _semi_auto_engine(layout: Layout, args: EngineArguments) -> Engine:
    """The pipeline engine for layouts with pipeline stages, the distributed engine for the others."""
    return (PipeliningEngine if layout.pp > 1 else DistributedEngine)(layout, args)


def _data_parallel_engine(layout: Layout, args: EngineArguments) -> Engine:
    return DistributedEngine(layout, args)


def _stand_alone_engine(layout: Layout, args: EngineArguments) -> Engine:
    return Engine(layout, args)


def current_world_size() -> int:
    """Processes of this run: the joined process group's size, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_layout(parallel_config: ParallelConfig, model_config: Any, world_size: int, per_device_batch: int,
                seq_length: int | None = None, summary: list[str] | None = None,
                trainable_params: int | None = None, fused_loss: bool = False) -> ParallelConfig:
    """The layout an ``auto_parallel`` config runs with on ``world_size`` processes for ``model_config``
    (:func:`~mindformers_py.planner.search.auto_parallel`: the fastest that fits, logged as a table; under a
    running process group every rank gets rank 0's plan; the rank that planned appends the plan's one-line reason to
    ``summary``), as a fixed config that :meth:`~ParallelConfig.resolve` turns into the run's ``Layout``; other modes
    are returned unchanged. ``trainable_params`` is a peft adapter's count (gradients and optimizer state for those
    alone); ``fused_loss`` the run's ``TrainingArguments.fused_loss``. A plan for one process is a ``stand_alone``
    layout (no process group to join: what an ``auto_parallel`` run on a machine without GPUs and without size hints
    gets)."""
    if parallel_config.parallel_mode != "auto_parallel":
        return parallel_config
    from ..planner.search import auto_parallel

    layout = auto_parallel(parallel_config, model_config, world_size, per_device_batch, seq_length, summary=summary,
                           trainable_params=trainable_params, fused_loss=fused_loss)
    if world_size == 1:
        layout = ParallelConfig.from_dict({**layout.to_dict(), "parallel_mode": "stand_alone"})
    return layout


def resolve_layout(parallel_config: ParallelConfig, world_size: int, model_config: Any = None,
                   per_device_batch: int | None = None, seq_length: int | None = None, *,
                   task: str | None = None) -> Layout:
    """The run's :class:`~mindformers_py.parallel.layout.Layout`: an ``auto_parallel`` config planned for
    ``world_size`` processes and the model first (:func:`plan_layout`, whose reason the layout keeps as
    ``plan_summary``), then checked once against the world, the model, the per-device batch and ``task``
    (:meth:`ParallelConfig.resolve`). ``seq_length`` is what the planner sizes activations by."""
    summary: list[str] = []
    if parallel_config.parallel_mode == "auto_parallel":
        if model_config is None:
            raise ConfigError("parallel_mode='auto_parallel' needs the model's config to plan a layout; pass the model "
                              "to the Trainer (or model_config= to build_engine)")
        parallel_config = plan_layout(parallel_config, model_config, world_size, per_device_batch, seq_length,
                                      summary=summary)
    layout = parallel_config.resolve(world_size, model_config, per_device_batch=per_device_batch, task=task)
    return dataclasses.replace(layout, plan_summary=summary[0]) if summary else layout


def local_world_size(parallel_config: ParallelConfig) -> int:
    """Processes an ``auto_parallel`` run started on this machine without torchrun plans for (the Trainer's own
    workers): every visible GPU, else the product of the config's size hints
    (:func:`~mindformers_py.planner.search.default_world_size`)."""
    from ..planner.search import default_world_size

    return default_world_size(parallel_config)


_ENGINES: dict[str, EngineFactory] = {
    "stand_alone": _stand_alone_engine,
    "data_parallel": _data_parallel_engine,
    "semi_auto_parallel": _semi_auto_engine,
}


def register_engine(parallel_mode: str, factory: EngineFactory) -> None:
    """Make ``factory(layout, args)`` the engine for ``parallel_mode`` (replacing the built-in one)."""
    _ENGINES[parallel_mode] = factory


def build_engine(layout: Layout | ParallelConfig, args: EngineArguments, *, model_config: Any = None,
                 seq_length: int | None = None, task: str | None = None) -> Engine:
    """The engine for a resolved ``layout``'s ``parallel_mode`` (not yet set up: call :meth:`Engine.setup`).

    A :class:`ParallelConfig` is resolved here first, once (:func:`resolve_layout`, for :func:`current_world_size`
    processes, ``model_config``, the arguments' per-device batch and ``task``; ``seq_length`` lets
    ``auto_parallel`` plan before any process group exists)."""
    if not isinstance(layout, Layout):
        layout = resolve_layout(layout, current_world_size(), model_config, args.per_device_train_batch_size,
                                seq_length, task=task)
    mode = layout.parallel_mode
    if mode not in _ENGINES:
        raise ConfigError(f"parallel_mode={mode!r} has no training engine; choose one of: "
                          f"{', '.join(repr(m) for m in _ENGINES)}")
    engine = _ENGINES[mode](layout, args)
    engine.plan_summary = layout.plan_summary  # the planner's reason, for the run's layout line
    return engine
