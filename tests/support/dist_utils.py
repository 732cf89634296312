"""Spawn gloo worker processes for multi-process tests, without torchrun.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes (forkserver: torch and our package are
imported once, then each worker is forked from that server), sets the torchrun environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free local port), joins a gloo process
group with a short timeout, calls ``fn(rank, world_size, *args, **kwargs)`` and returns every rank's return value,
indexed by rank. A worker's exception fails the call with that worker's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

WORKER_TIMEOUT_S = 120
# The package's exports are lazy: name the Trainer's and the engines' modules so that the server imports them once,
# not every forked worker (about 10 s each on a loaded 2-core machine).
_PRELOAD = ["torch", "torch.distributed", "transformers", "datasets", "mindformers_py", "mindformers_py.trainer.trainer",
            "mindformers_py.engine.registry", "mindformers_py.recipes.runner"]  # the package's FORKSERVER_PRELOAD


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a worker that should have been stopped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, environ: dict[str, str],
            cwd: str, args: tuple, kwargs: dict) -> None:
    # The fork server keeps the environment and folder of the moment it started, perhaps inside an earlier test
    # that had monkeypatched MINDFORMERS_PY_LAYOUT or RANK (or inside a CLI run that started it): a worker takes
    # the calling test's, exactly, as torchrun's workers would.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args, **kwargs)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes; return their results by rank.

    ``fn`` must be importable (a module-level function) and its result picklable.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="mf-dist-") as out_dir:
        mp.start_processes(_worker, args=(fn, world_size, free_port(), out_dir, dict(os.environ), os.getcwd(), args,
                                          kwargs), nprocs=world_size, join=True, start_method="forkserver")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
