"""The Trainer starting its own worker processes, from a script or a notebook.

A layout that needs more processes than the program has (``data_parallel=2``, ``model_parallel=2``, an
``auto_parallel`` plan for the local GPUs, ...) runs without torchrun: ``Trainer(...)`` then builds no engine and
joins no process group in the calling process (the *parent*), and each ``train()`` / ``evaluate()`` / ``predict()``
starts the workers on the same launch machinery as ``mindformers-py run`` (torch's elastic agent, through
:func:`~mindformers_py.launcher.launch.launch_from_python`), runs the call there, and brings the result back.

**How objects reach the workers.** The Trainer as it is at the call (its model with its current weights, datasets,
collator, tokenizer, ``compute_metrics``, callbacks, arguments, and the Trainer subclass itself) is pickled with
cloudpickle into a temporary file that every worker reads. cloudpickle sends functions and classes defined in the
script or notebook (lambdas, local classes, a ``Trainer`` subclass written in a cell) by value, and everything
importable by reference. Each worker gets its own copy; the parent's objects are not shared. The model's weights are
the exception: they travel as a reference (:mod:`~mindformers_py.loading.handover`), to the checkpoint they were
loaded from when unchanged since, else to one copy written once for the call, and each worker reads only its own
shards, so none holds a whole copy of a model its layout shards.

**What cannot reach them**, refused before any worker starts, in one line naming the argument: objects that do not
pickle (open files, sockets, locks, generators, a ``torch.utils.data.DataLoader`` iterator, ...), and
``optimizers=(optimizer, scheduler)`` objects (the layout replaces the parameters such an optimizer holds: set
``optim`` / ``learning_rate`` / ``lr_scheduler_type`` in the arguments instead).

**What comes back** to the parent: the call's result (``TrainOutput``, the metrics, ``PredictionOutput``),
``trainer.state`` (``log_history`` included), and after ``train()`` the trained weights, copied into the parent's
``trainer.model`` (consolidated from every rank's shards; of a peft model, its adapter), so the next cell's ``trainer.evaluate()``,
``trainer.save_model()`` or ``pipeline(..., model=trainer.model)`` works unchanged. Rank 0's progress bar is drawn by
the parent (a widget in a notebook). What the workers change in their copies of other objects (a callback's list, a
global variable) stays in the workers; files they write (checkpoints, ``log.jsonl``, TensorBoard) are where the
arguments say, as under the CLI, and ``resume_from_checkpoint`` reads them.

**Failures.** An exception in a worker raises one line here naming the rank and the error (a
:class:`~mindformers_py.errors.MindFormersError` keeps its class; others raise
:class:`~mindformers_py.launcher.launch.LaunchError`), with the traceback saved in
``<output_dir>/worker_errors/rank<N>.txt``; a worker killed by the system ends the call within a second or two, naming
the rank and the signal; an interrupt (Ctrl-C, the notebook's stop button) stops every worker and raises
``KeyboardInterrupt``. The other workers are always stopped.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist
from transformers import TrainerControl, TrainerState
from transformers.utils import logging as hf_logging

from ..adapters.apply import is_peft_model, load_adapter_weights
from ..engine import Engine
from ..engine.registry import local_world_size, plan_layout
from ..checkpoint.state_files import copy_weights
from ..errors import ConfigError, MindFormersError
from ..loading.handover import dumps, weights_by_reference
from ..parallel.config import ParallelConfig
from ..parallel.layout import Layout
from ..parallel.context.checks import check_compile
from ..launcher.launch import LaunchError, adopt_environment, launch_from_python, launched_by_torchrun, lost_a_peer, \
    threads_per_worker
from ..checkpoint.safetensors_io import load_state_dict
from .callbacks import ProgressCallback

ERRORS_DIR = "worker_errors"
"""Folder of ``output_dir`` where a failed worker leaves its traceback (``rank<N>.txt``)."""
_JOB_NAME, _WEIGHTS_DIR, _PARENT_WEIGHTS_DIR = "job.pkl", "weights", "parent_weights"
# The callback events a progress display reacts to; rank 0 relays them to the parent.
_RELAYED_EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_predict", "on_prediction_step",
                   "on_train_end")
# Trainer attributes -> the constructor argument a user knows them by (for the one-line refusal).
_ARGUMENT_NAMES = {"processing_class": "processing_class (tokenizer)", "callback_handler": "callbacks"}


def planned_layout(parallel_config: ParallelConfig, model_config: Any, per_device_batch: int,
                   seq_length: int | None) -> tuple[int, ParallelConfig]:
    """``(processes, layout)`` a run started here needs: 1 under torchrun or in a joined process group (the world
    is given; the engine reads it), else the layout's size, or for ``auto_parallel`` the planner's layout for the
    local processes (every visible GPU, else the product of the config's size hints)."""
    if launched_by_torchrun() or (dist.is_available() and dist.is_initialized()):
        return 1, parallel_config
    if parallel_config.parallel_mode != "auto_parallel":
        return parallel_config.required_world_size(), parallel_config
    world = local_world_size(parallel_config)
    if world == 1 or model_config is None:
        return 1, parallel_config  # the engine plans the one-process layout (or names what is missing)
    return world, plan_layout(parallel_config, model_config, world, per_device_batch, seq_length)


@dataclass
class LocalWorkers:
    """The worker processes a Trainer starts for each call (see the module docstring)."""

    world_size: int
    """Processes per call."""
    config: ParallelConfig
    """The fixed config the workers run (the planner's answer for ``auto_parallel``): their arguments'."""
    layout: Layout
    """``config`` resolved here, once, for the workers; they take it as it is (checking nothing again)."""

    @classmethod
    def plan(cls, args: Any, model: Any, seq_length: int | None, task: str | None = None) -> LocalWorkers | None:
        """The workers a Trainer with ``args`` and ``model`` needs, or None when it runs in this process. The layout
        is resolved against the model, the batch and the ``task`` here, before anything starts, and sent to them."""
        world, config = planned_layout(args.parallel_config, getattr(model, "config", None),
                                       args.per_device_train_batch_size, seq_length)
        if world <= 1:
            return None
        layout = config.resolve(world, getattr(model, "config", None), per_device_batch=args.per_device_train_batch_size,
                                task=task)
        check_compile(layout.cp, bool(args.torch_compile))
        return cls(world, config, layout)

    def host_engine(self, args: Any) -> Engine:
        """The parent's engine: stand-alone, without a process group; it saves and loads the parent's whole model
        (``save_model``, ``finetune``'s weights)."""
        return Engine(Layout("stand_alone"), args)

    def run(self, trainer: Any, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(trainer, *args, **kwargs)`` (``Trainer.train``, ...) in the workers; returns rank 0's result
        and updates the parent's state (and model, after training)."""
        if trainer.optimizer is not None or trainer.lr_scheduler is not None:
            raise ConfigError(
                f"optimizers=(optimizer, scheduler) cannot be used when the Trainer starts its {self.world_size} "
                "worker processes (the layout replaces the parameters the optimizer holds); set optim, learning_rate "
                "and lr_scheduler_type in TrainingArguments instead")
        folder = Path(tempfile.mkdtemp(prefix="mindformers-workers-"))
        progress = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback)]
        relay = _EventPump(trainer, progress) if progress else None
        try:
            weights = folder / _WEIGHTS_DIR if function.__name__ == "train" else None
            job = _Job(trainer=trainer, function=function, args=args, kwargs=kwargs, env=dict(os.environ),
                       threads=threads_per_worker(self.world_size), weights=str(weights) if weights else None,
                       folder=str(folder))
            # The model's weights are not pickled: each worker reads only its shards from their checkpoint (or from
            # one copy written here), so no worker holds a whole copy of a model its layout shards.
            with self._as_sent(trainer), weights_by_reference(trainer.model, folder / _PARENT_WEIGHTS_DIR) as by_ref:
                _write_job(job, folder / _JOB_NAME, self.world_size, by_ref)
            if relay is not None:
                relay.start()
            try:
                results = launch_from_python(_worker_main, self.world_size, str(folder / _JOB_NAME),
                                             relay.queue if relay is not None else None,
                                             max_restarts=trainer.args.max_restarts)
            except LaunchError as err:
                raise _worker_failure(err, folder, trainer.args.output_dir, self.world_size) from None
            finally:
                if relay is not None:
                    relay.stop()
            out = cloudpickle.loads(results[0])
            trainer.state = dataclasses.replace(out["state"], is_world_process_zero=True, is_local_process_zero=True)
            if weights is not None and is_peft_model(trainer.model):  # the workers saved the adapter alone
                load_adapter_weights(trainer.model, weights)
            elif weights is not None:
                copy_weights(trainer.model, load_state_dict(weights), "the workers' trained weights")
            return out["result"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def _as_sent(self, trainer: Any) -> Iterator[None]:
        """``trainer`` as the workers get it while it is pickled: their layout, no parent engine. The object itself,
        not a copy, so what refers to it (its bound methods held by the loss, the callbacks) refers to the one the
        workers set up."""
        sent = {"_workers": None, "engine": None, "model_wrapped": None,
                "args": trainer.args.with_layout(self.config).with_resolved_layout(self.layout)}
        kept = {name: getattr(trainer, name) for name in sent}
        vars(trainer).update(sent)
        try:
            yield
        finally:
            vars(trainer).update(kept)


@dataclass
class _Job:
    """What every worker reads: the Trainer, the call, and the parent's environment."""

    trainer: Any
    function: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    env: dict[str, str]
    threads: int
    weights: str | None
    """Folder the workers write the trained weights to (after ``train``), else None."""
    folder: str
    """The call's temporary folder (exceptions of the workers are pickled there)."""


def _write_job(job: _Job, path: Path, world_size: int, by_reference: set[int] = frozenset()) -> None:
    """Pickle ``job`` with cloudpickle (the parameters ``by_reference`` as empty ``meta`` ones,
    :mod:`~mindformers_py.loading.handover`); an object that does not pickle is refused in one line naming it."""
    try:
        data = dumps(job, set(by_reference))
    except Exception:  # noqa: BLE001 - pickling raises many types; the culprit is found below
        name, value, err = _unpicklable_part(job.trainer)
        raise ConfigError(
            f"the Trainer cannot send its {name} ({type(value).__name__}) to the {world_size} worker processes it "
            f"starts ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); pass an object that "
            "pickles (cloudpickle: no open files, sockets, locks or generators), or start the script with torchrun"
        ) from None
    path.write_bytes(data)


def _unpicklable_part(trainer: Any) -> tuple[str, Any, Exception]:
    """(argument name, value, error) of the first part of ``trainer`` that cloudpickle refuses."""
    for name, value in vars(trainer).items():
        try:
            cloudpickle.dumps(value)
        except Exception as err:  # noqa: BLE001
            if name == "callback_handler":
                for i, callback in enumerate(value.callbacks):
                    try:
                        cloudpickle.dumps(callback)
                    except Exception as inner:  # noqa: BLE001
                        return f"callback {type(callback).__name__}", callback, inner
            return _ARGUMENT_NAMES.get(name, name), value, err
    return "Trainer", trainer, RuntimeError("an unpicklable attribute")


def _worker_failure(err: LaunchError, folder: Path, output_dir: str, world_size: int) -> Exception:
    """The parent's one-line error for a failed call: the worker's own MindFormersError (a user error, with its
    rank), else a LaunchError naming the rank, the exception and the traceback file; a killed worker's LaunchError
    as the launcher wrote it."""
    if err.rank is None or (err.exitcode is not None and err.exitcode < 0):
        return err  # killed by a signal: the launcher's line names it
    recorded = {}
    for path in folder.glob("error_rank*.pkl"):
        try:
            recorded[int(path.stem.removeprefix("error_rank"))] = cloudpickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001 - an exception class that does not unpickle here
            continue
    rank = err.rank
    if rank not in recorded or lost_a_peer(recorded[rank]):
        # The reported rank only lost a peer: name a rank that failed by itself, if one did.
        rank = next((r for r, exc in sorted(recorded.items()) if not lost_a_peer(exc)), rank)
    if rank not in recorded:
        return err
    exc = recorded[rank]
    first = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, MindFormersError):
        try:
            return type(exc)(f"rank {rank} of {world_size}: {first}")
        except TypeError:  # a subclass with another constructor
            pass
    where = Path(output_dir) / ERRORS_DIR / f"rank{rank}.txt"
    return LaunchError(f"rank {rank} of {world_size} workers failed with {type(exc).__name__}: {first} "
                       f"(traceback in {where}); the other ranks were stopped")


# -- the worker side ----------------------------------------------------------------------------------------------


def _worker_main(job_path: str, events: Any) -> bytes | None:
    """One worker: read the job, build the engine (joining the workers' process group), run the call; rank 0 returns
    the pickled result and state."""
    job: _Job = cloudpickle.loads(Path(job_path).read_bytes())
    adopt_environment(job.env)  # workers fork from a server started earlier: the parent's environment as it is now
    torch.set_num_threads(job.threads)
    hf_logging.disable_progress_bar()  # the whole-weights save's "Writing model shards": rank 0's bar is the parent's
    rank = int(os.environ["RANK"])
    trainer = job.trainer
    try:
        _start_trainer(trainer, events if rank == 0 else None)
        result = job.function(trainer, *job.args, **job.kwargs)
        if job.weights is not None:  # collective: rank 0 writes the whole weights from every rank's shards
            trainer.engine.save_pretrained(trainer.model, job.weights)
        trainer.engine.teardown()
        return cloudpickle.dumps({"result": result, "state": trainer.state}) if rank == 0 else None
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # an exit code, so the agent stops the job (torch would exit 0)
    except BaseException as exc:
        _record_failure(exc, rank, trainer.args.output_dir, Path(job.folder))
        raise  # one that lost a peer waits first in launch's wrapper, so the agent names the peer


def _start_trainer(trainer: Any, events: Any) -> None:
    """Build the Trainer's engine in this worker and, on rank 0, relay the progress callbacks' events to the
    parent (which draws the bar) instead of drawing one here."""
    trainer._setup_engine()
    trainer.engine.check_loss(trainer.training_loss)  # the layout's own refusals (the parent checked stand-alone's)
    trainer.state.is_world_process_zero = trainer.engine.is_main_process
    trainer.state.is_local_process_zero = trainer.engine.is_local_main_process
    if events is not None:
        handler = trainer.callback_handler
        handler.callbacks = [_Relay(events) if isinstance(cb, ProgressCallback) else cb for cb in handler.callbacks]


def _record_failure(exc: BaseException, rank: int, output_dir: str, folder: Path) -> None:
    """Save the traceback in ``<output_dir>/worker_errors/rank<N>.txt`` and the exception for the parent."""
    try:
        where = Path(output_dir) / ERRORS_DIR
        where.mkdir(parents=True, exist_ok=True)
        (where / f"rank{rank}.txt").write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        (folder / f"error_rank{rank}.pkl").write_bytes(cloudpickle.dumps(exc))
    except Exception:  # noqa: BLE001 - reporting must not hide the failure itself
        pass


class _Relay:
    """Stands in for rank 0's progress callbacks: sends their events to the parent (a small copy of the state, the
    logs or metrics)."""

    def __init__(self, events: Any) -> None:
        self.events = events

    def __getattr__(self, name: str) -> Callable[..., None]:
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda args, state, control, **kwargs: self._send(name, state, kwargs)

    def _send(self, name: str, state: TrainerState, kwargs: dict[str, Any]) -> None:
        if name not in _RELAYED_EVENTS:
            return
        small = copy.copy(state)
        small.log_history = []
        sent = {k: kwargs[k] for k in ("logs", "metrics") if k in kwargs}
        self.events.put((name, small, sent))


# -- the parent side ----------------------------------------------------------------------------------------------


class _EventPump:
    """Feeds rank 0's relayed events to the parent's progress callbacks from a background thread (the main thread
    runs the elastic agent, which needs it for signals)."""

    def __init__(self, trainer: Any, callbacks: list[ProgressCallback]) -> None:
        self.trainer = trainer
        self.callbacks = callbacks
        self.queue = multiprocessing.get_context("forkserver").Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="mindformers-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Show what is left in the queue, then close any bar a failed call left open."""
        self._stop.set()
        self._thread.join(timeout=5)
        for callback in self.callbacks:
            if getattr(callback, "bar", None) is not None:
                callback.on_train_end(self.trainer.args, self.trainer.state, TrainerControl())
        self.queue.close()

    def _pump(self) -> None:
        while True:
            try:
                name, state, kwargs = self.queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            except (EOFError, OSError):
                return
            state.is_world_process_zero = state.is_local_process_zero = True
            for callback in self.callbacks:
                getattr(callback, name)(self.trainer.args, state, TrainerControl(), model=self.trainer.model,
                                        **kwargs)
