"""Process launch with torchrun's own machinery (torchelastic's local agent and c10d rendezvous).

A distributed layout needs ``data_parallel * context_parallel * model_parallel * pipeline_stage`` processes. Started
by ``torchrun`` (which sets ``LOCAL_RANK``/``WORLD_SIZE``), a process simply joins the world it was given. Started by hand
(``mindformers-py run recipe.yaml --parallel_mode semi_auto_parallel``), it has no world yet, so
:func:`launch` starts the processes on this node, exactly as ``torchrun --standalone --nproc_per_node N`` would:
a local c10d rendezvous and an elastic agent that watches the workers. When one worker dies (an exception, a kill,
an out-of-memory), the agent stops the others and :func:`launch` raises :class:`LaunchError` naming the rank, so a
job never hangs in a collective waiting for a peer that is gone; with ``max_restarts`` it first restarts the whole
group that many times, recording each cause for the restarted workers (:func:`restart_info`).

Several nodes: run one torchrun agent per node with the same rendezvous endpoint (see :func:`multinode_command`)::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29400 --rdzv_id job1 \\
        -m mindformers_py run tasks/gpt/pretrain_tiny.yaml --parallel_mode semi_auto_parallel

where HOST is the address of one of the nodes (reachable from all of them); every node runs the same command.

From a Python program or a notebook kernel (the Trainer's and the parallel pipelines' own workers),
:func:`launch_from_python` runs a function in local workers on the same agent, with what such a caller needs: fast
starts (a fork server that imported torch once), the caller's main module not run again, its signal handlers kept,
and an interrupt turned into ``KeyboardInterrupt`` once every worker stopped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import LaunchConfig

from ..errors import ConfigError, MindFormersError
from .restarts import RESTART_LOG_ENV, RestartInfo, restart_info  # noqa: F401 - re-exported for launch's users

logger = logging.getLogger(__name__)

# Variables torchrun sets in every worker; their presence means "already launched".
TORCHRUN_ENV = ("LOCAL_RANK", "WORLD_SIZE")


class LaunchError(MindFormersError):
    """A launched worker failed; the job was stopped. The message names the first failing rank and its exit;
    ``rank`` and ``exitcode`` hold them (None when the job stopped for another reason)."""

    rank: int | None = None
    exitcode: int | None = None


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in a torchrun-launched job (from the environment torchrun sets)."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    world_size: int
    """Processes in the whole job."""
    local_world_size: int
    """Processes on this node."""


def distributed_env(environ: dict[str, str] | None = None) -> DistributedEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    env = os.environ if environ is None else environ
    if not all(key in env for key in TORCHRUN_ENV):
        return None
    world = int(env["WORLD_SIZE"])
    return DistributedEnv(
        rank=int(env.get("RANK", env["LOCAL_RANK"])),
        local_rank=int(env["LOCAL_RANK"]),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def launched_by_torchrun() -> bool:
    """Whether this process is a worker started by torchrun (or by :func:`launch`)."""
    return distributed_env() is not None


def needs_launch(world_size: int) -> bool:
    """Whether a job of ``world_size`` processes must be started from here: more than one process is needed
    and this process is not already one of torchrun's workers."""
    return world_size > 1 and not launched_by_torchrun()


def check_world_size(required: int) -> int:
    """The world size to run with: torchrun's when launched by it (which must equal ``required``), else
    ``required``. Raises a ConfigError naming both sizes when torchrun started a different number of workers."""
    env = distributed_env()
    if env is None:
        return required
    if env.world_size != required:
        raise ConfigError(
            f"the parallel layout needs world_size={required} processes but torchrun started WORLD_SIZE="
            f"{env.world_size}; set --nproc_per_node/--nnodes to give {required} processes or change the layout"
        )
    return env.world_size


def _cause(err: ChildFailedError) -> tuple[int, Any]:
    """``(rank, failure)`` of the rank that caused the job to fail (see :func:`_failure_summary`)."""
    def order(item: tuple[int, Any]) -> tuple[bool, bool, float, int]:
        rank, failure = item
        return failure.exitcode == -signal.SIGTERM, failure.exitcode >= 0, failure.timestamp, rank

    return min(err.failures.items(), key=order)


def _failure_summary(err: ChildFailedError) -> str:
    """``rank R of the job failed with exit code C (SIGNAL)[: first line of its exception][ (N more rank(s) failed)]``.

    The rank named is the cause: one killed by a signal (SIGKILL, an out-of-memory kill) before those that exited
    with an error (a peer's death makes the others' collectives fail with connection errors, sometimes before the
    agent sees the kill), then the earliest. SIGTERM comes after both: it is what the agent sends the ranks it stops
    once one failed, so a rank ended by it is a consequence unless nothing else failed."""
    rank, failure = _cause(err)
    code = failure.exitcode
    how = f"exit code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    message = failure.message
    if isinstance(message, dict):  # from the worker's error file: the exception it raised
        message = message.get("message", "")
    elif not os.path.isfile(str(failure.error_file)):
        message = ""  # torchelastic's generic hint; the worker printed its own traceback above
    # A signal is already named above; an exception's first line says what went wrong.
    detail = f": {str(message).splitlines()[0]}" if message and code >= 0 else ""
    others = len(err.failures) - 1
    tail = f" ({others} more rank(s) failed)" if others > 0 else ""
    return f"rank {rank} of the job failed with {how}{detail}{tail}"


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away (torch's ``DistError`` family, or
    gloo's "connection reset/closed by peer"): a consequence of another rank's failure, which the launcher names."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "by peer" in str(exc))


def _describe_failure(err: ChildFailedError) -> str:
    return f"{_failure_summary(err)}; the other ranks were stopped"


# -- restarts: the agent records why it restarted the workers, the restarted workers read it -------------------------

class _RestartRecordingAgent(LocalElasticAgent):
    """torchelastic's local agent that, before restarting the worker group, appends the failure that caused it to
    the restart log (:data:`RESTART_LOG_ENV`), so the restarted workers can log it."""

    def __init__(self, *args: Any, restart_log: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._restart_log = restart_log
        self._failure: tuple[str, float] | None = None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and result.failures:
            summary = _failure_summary(ChildFailedError("workers", result.failures))
            self._failure = (summary, time.time())
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # A stopped (SIGSTOP) worker cannot take SIGTERM: continue it first, so it ends now rather than after the
        # shutdown timeout (which torch's agent does not apply here: it waits 30 s).
        for worker in worker_group.workers:
            if isinstance(worker.id, int):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(worker.id, signal.SIGCONT)
        self._shutdown(timeout=self._shutdown_timeout)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        cause, failed_at = self._failure or ("the worker group changed (a node joined or left)", time.time())
        self._failure = None
        with open(self._restart_log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"cause": cause, "failed_at": failed_at}) + "\n")
        logger.warning("restarting the workers: %s", cause)
        super()._restart_workers(worker_group)


def _run_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: Sequence[Any],
               restart_log: str) -> dict[int, Any]:
    """``elastic_launch(config, entrypoint)(*args)`` with :class:`_RestartRecordingAgent`: the same rendezvous, worker
    spec and failure report (``ChildFailedError``) as torch's ``launch_agent``, from torchelastic's public classes."""
    rdzv = rdzv_registry.get_rendezvous_handler(RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id, min_nodes=config.min_nodes,
        max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs))
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=rdzv, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, local_addr=config.local_addr)
    agent = _RestartRecordingAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                                   shutdown_timeout=config.shutdown_timeout, restart_log=restart_log)
    try:
        result = agent.run()
    finally:
        rdzv.shutdown()
    if result.is_failed():
        raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
    return result.return_values


# torchelastic >= 2.4 lets the workers' process group share the agent's rendezvous store, whose keys outlive a
# restart: restarted workers then read their predecessors' addresses and fail to connect (pytorch/pytorch#135712,
# #167288). With restarts the workers get a store of their own per attempt, as before 2.4.
_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _restartable_store(max_restarts: int) -> contextlib.AbstractContextManager[None]:
    return _environment(_SHARED_STORE_ENV, "1") if max_restarts > 0 else contextlib.nullcontext()


PEER_GRACE_S = 1.0
"""How long a worker whose collective failed because a peer went away waits before it exits: the agent (polling every
0.1 s) then sees the peer's failure first and names it, not this consequence (function workers report only the
first failed process the agent finds). The agent's SIGTERM usually ends the wait early."""


def _call_with_environment(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """``target(*args)`` in a worker, after setting ``environ``; a worker that lost a peer waits
    :data:`PEER_GRACE_S` before it fails."""
    os.environ.update(environ)
    try:
        return target(*args)
    except Exception as exc:
        if lost_a_peer(exc):
            time.sleep(PEER_GRACE_S)
        raise


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` while the workers run (they inherit it), restored afterwards."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _launch_error(err: ChildFailedError, suffix: str = "") -> LaunchError:
    error = LaunchError(_describe_failure(err) + suffix)
    error.rank, failure = _cause(err)
    error.exitcode = failure.exitcode
    return error


@contextlib.contextmanager
def _worker_threads(nproc: int) -> Iterator[None]:
    """As torchrun: one OpenMP thread per worker unless the user chose, so N workers do not oversubscribe."""
    if "OMP_NUM_THREADS" in os.environ or nproc <= 1:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def launch(
    target: Callable[..., Any] | Sequence[str],
    nproc: int,
    *args: Any,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    start_method: str = "spawn",
    shutdown_timeout: int | None = None,
) -> dict[int, Any]:
    """Run ``target`` in ``nproc`` worker processes on this node and wait for all of them.

    Args:
        target: a picklable function (called as ``target(*args)`` in each worker; the return values come back),
            or the arguments of a Python command line run in each worker, e.g.
            ``["-m", "mindformers_py", "run", "recipe.yaml"]`` (``args`` must then be empty).
        nproc: workers on this node.
        nnodes: nodes in the job; with more than one, every node calls this with the same ``rdzv_endpoint``
            and ``run_id`` (``torchrun --nnodes`` does the same from the shell).
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous; default: a free local port (single node).
        run_id: rendezvous id shared by the nodes of one job; default: a fresh one.
        max_restarts: times the whole group is restarted after a failure (0: fail at once); each restart's cause
            reaches the restarted workers (:func:`restart_info`), and a Trainer among them resumes from its latest
            complete checkpoint.
        monitor_interval: seconds between the agent's checks of its workers (how fast a death is noticed).
        start_method: how function workers are started (``spawn`` is safe with threads and CUDA).
        shutdown_timeout: seconds the agent waits for workers it stops with SIGTERM before it kills them (default:
            torchelastic's, 30; a frozen worker cannot take SIGTERM and is killed only then).

    Returns:
        ``{global_rank: return value}`` for this node's workers (None for command lines).

    Raises:
        LaunchError: a worker failed or was killed; the others were stopped.
    """
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"nproc={nproc}, nnodes={nnodes} is not valid; expected integers >= 1")
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError(f"rdzv_endpoint={rdzv_endpoint!r} is not valid with nnodes={nnodes}; expected HOST:PORT")
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=run_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        shutdown_timeout=shutdown_timeout,
    )
    with tempfile.TemporaryDirectory(prefix="mindformers-launch-") as scratch:
        restart_log = os.path.join(scratch, "restarts.jsonl")
        if callable(target):
            # Function workers may fork from a server started earlier (forkserver), with that moment's environment:
            # they are handed the restart log explicitly. Command lines inherit the environment set below.
            entrypoint: Callable[..., Any] | str = functools.update_wrapper(
                functools.partial(_call_with_environment, {RESTART_LOG_ENV: restart_log}, target), target)
            call_args: tuple[Any, ...] = args
        else:
            if args:
                raise ConfigError("launch() takes extra args only with a function target; put them in the command line")
            entrypoint, call_args = sys.executable, ("-u", *target)
        try:
            with _worker_threads(nproc), _environment(RESTART_LOG_ENV, restart_log), _restartable_store(max_restarts):
                return _run_agent(config, entrypoint, call_args, restart_log)
        except ChildFailedError as err:
            restarts = f" (after {max_restarts} restart(s))" if max_restarts else ""
            raise _launch_error(err, restarts) from None


def multinode_command(nnodes: int, nproc_per_node: int, endpoint: str, program_args: Sequence[str],
                      run_id: str = "mindformers") -> str:
    """The torchrun command each of ``nnodes`` nodes runs for a multi-node job (printed in docs and by the CLI).

    ``endpoint`` is ``HOST:PORT`` of one node that all nodes reach; ``program_args`` the ``mindformers-py``
    arguments, e.g. ``["run", "recipe.yaml", "--parallel_mode", "semi_auto_parallel"]``.
    """
    parts = ["torchrun", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc_per_node),
             "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
             "-m", "mindformers_py", *program_args]
    return shlex.join(parts)


# -- launching from a Python program or a notebook ----------------------------------------------------------------

FORKSERVER_PRELOAD = ("torch", "torch.distributed", "transformers", "datasets", "mindformers_py",
                      "mindformers_py.engine.registry", "mindformers_py.trainer.trainer", "mindformers_py.recipes.runner")
"""Modules the fork server imports once, so each launched worker starts without importing them again. The package's
exports are lazy, so the engines', the Trainer's and the recipe runner's modules are named (by name only: nothing
here imports them): without them every worker, and every restarted one, imported them itself (about 10 s each on a
loaded 2-core machine; ``datasets``, which a recipe's rank reads its data with, 2.5 s more). Whichever launcher starts
the server first fixes its list, so every launcher shares this one."""
_HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, name))


def launch_from_python(target: Callable[..., Any], nproc: int, *args: Any,
                       preload: Sequence[str] = FORKSERVER_PRELOAD, max_restarts: int = 0) -> dict[int, Any]:
    """:func:`launch` of a function from a Python program or a notebook kernel; returns ``{rank: return value}``.

    What differs from calling :func:`launch` with a function:

    * Workers fork from multiprocessing's fork server, which imports ``preload`` once per program (the first
      launch pays for it; later ones start in about a second). The server stays up, idle, until the program ends.
    * The caller's main module (a script, ``python -m module``) is not run again in the workers, as ``spawn`` would
      do to a script without an ``if __name__ == "__main__":`` guard: ``target`` and ``args`` must carry what the
      workers need (pickled; objects defined in the script or notebook travel by value with cloudpickle).
    * The signal handlers the elastic agent installs are removed again afterwards, and an interrupt (Ctrl-C, the
      notebook's stop button) stops every worker and then raises ``KeyboardInterrupt`` here.

    ``max_restarts`` is :func:`launch`'s: the workers are restarted (forked again) that many times after a failure.

    Raises:
        LaunchError: a worker failed or was killed (naming its rank and exit code or signal); the others were
            stopped.
        KeyboardInterrupt: the program was interrupted; every worker was stopped.
    """
    prepare_fork_server(preload)
    saved = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    try:
        with main_module_not_rerun(), quiet_agent():
            return launch(target, nproc, *args, start_method="forkserver", max_restarts=max_restarts)
    except SignalException as err:
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise LaunchError(f"the launch was stopped by {err.sigval.name}; every worker was stopped") from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


# What the elastic agent sets in each worker's environment: the launching program's values (a notebook's MASTER_PORT)
# must not replace them.
AGENT_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                   "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _set_by_agent(name: str) -> bool:
    """Whether the agent, or :func:`launch` through it (the restart log), sets ``name`` for each worker."""
    return name in AGENT_VARIABLES or name.startswith("TORCHELASTIC_") or name == RESTART_LOG_ENV


def adopt_environment(env: Mapping[str, str]) -> None:
    """In a worker forked from the fork server (which has the environment of the moment it started), make the
    launching program's environment ``env`` as it is now this worker's, keeping what the agent set for this worker.
    Exactly ``env``: a variable the program has unset since the server started (an earlier launch's
    ``MINDFORMERS_PY_LAYOUT``, a test's monkeypatched setting) must not reach the worker."""
    agent = {k: v for k, v in os.environ.items() if _set_by_agent(k)}
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if not _set_by_agent(k)})
    os.environ.update(agent)


def threads_per_worker(nproc: int) -> int:
    """CPU threads for each of ``nproc`` local workers: ``OMP_NUM_THREADS`` when set (torchrun's rule), else the
    cores shared out."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // nproc)


def prepare_fork_server(preload: Sequence[str] = FORKSERVER_PRELOAD) -> None:
    """Have multiprocessing's fork server import ``preload`` when it starts (no effect once it runs: it has)."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))


def start_fork_server(preload: Sequence[str] = FORKSERVER_PRELOAD) -> None:
    """Start the fork server now, so that it imports ``preload`` (about 10 s of a core) while this process still has
    work to do before its launch (a recipe's tokenizer and data), on another core; the launch then finds it ready.
    Workers take the launcher's environment, folder and stdio at the launch (:func:`adopt_environment`), not the
    server's of this moment."""
    from multiprocessing import forkserver

    prepare_fork_server(preload)
    with main_module_not_rerun():
        forkserver.ensure_running()


@contextlib.contextmanager
def main_module_not_rerun() -> Iterator[None]:
    """Hide the main module's origin while workers start: multiprocessing would otherwise import a script (or a
    ``python -m`` module) again in each worker, running its top-level code, which starts the run again when it lacks
    a ``__main__`` guard. Workers get everything they need pickled, so they do not need the main module."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    hidden = {name: main.__dict__.pop(name) for name in ("__file__",) if name in main.__dict__}
    spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(hidden)
        main.__spec__ = spec


@contextlib.contextmanager
def quiet_agent() -> Iterator[None]:
    """Silence the elastic agent's logs (a failed worker's traceback, the shutdown warning): the caller raises one
    line for them instead."""
    import logging

    names = [name for name in list(logging.Logger.manager.loggerDict)
             if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"))]
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, saved):
            logger.disabled = disabled
