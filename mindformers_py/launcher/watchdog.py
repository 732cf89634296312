"""Hang detection: a job whose ranks stop making progress ends, naming the rank that did not arrive.

A rank that dies is seen at once by torch's elastic agent; a rank that hangs is not: the others wait in their next
collective (a SIGSTOPped process, one stuck in a deadlock, a host that stopped answering). :class:`ProgressWatchdog`
runs one thread per rank that

* publishes, every ``interval`` seconds, this rank's progress (how many times the training loop called :meth:`beat`,
  and the step it was at) and a heartbeat counter to the job's c10d key-value store (the one torchrun's rendezvous or
  ``init_process_group`` set up, reached at ``MASTER_ADDR:MASTER_PORT``);
* when this rank's own loop has not called :meth:`beat` for ``timeout_s`` seconds, reads every rank's record twice,
  an interval apart, and names the culprit: ranks whose heartbeat stopped (stopped or frozen processes), else the
  ranks furthest behind (the ones the others wait for), else all of them (a collective none can finish, a deadlock);
* then ends this process (exit status 1), after writing the one-line diagnosis to torchelastic's error file (so the
  launcher's error names it) and, from the lowest rank still alive, to stderr.

The elastic agent then stops the other ranks, restarting the group when ``max_restarts`` allows. A frozen (stopped)
process cannot take the agent's SIGTERM: the diagnosing ranks continue (SIGCONT) the frozen ones on their host first.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import MindFormersError

PREFIX = "mindformers/progress"
_HEARTBEATS_WATCHED = 3  # heartbeats a diagnosis waits for before calling a rank frozen
_starts = 0  # watchdogs started by this process: ranks start theirs in the same order, so the count names a run


class ProgressTimeoutError(MindFormersError):
    """Ranks of a distributed job made no progress for ``ddp_timeout`` seconds; the message names the culprit."""


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats for a ``timeout_s`` watchdog: a tenth of it, between 0.2 and 30 s."""
    return min(max(timeout_s / 10, 0.2), 30.0)


def collective_timeout(timeout_s: float) -> float:
    """The process group's own timeout for a ``timeout_s`` watchdog: late enough that the watchdog, which can name
    the rank that did not arrive, acts first; a collective timeout remains the backstop."""
    return timeout_s + 3 * heartbeat_interval(timeout_s) + 5


@dataclass
class _Record:
    beats: int
    step: int
    heartbeat: int
    host: str
    pid: int


class ProgressWatchdog:
    """Ends this rank's process when its training loop makes no progress for ``timeout_s`` seconds, with a
    diagnosis naming the rank(s) the job waits for (see the module docstring).

    Use :meth:`start` / :meth:`stop` around the work (or ``with watchdog:``) and call :meth:`beat` at each point
    of progress (every optimizer step, evaluation batch, checkpoint); all ranks must beat at the same points.
    """

    def __init__(self, timeout_s: float, rank: int, world_size: int, interval_s: float | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s if interval_s is not None else heartbeat_interval(self.timeout_s)
        self._beats = 0
        self._step = 0
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None
        self._reporter = rank  # the lowest rank still alive, which prints the diagnosis (set by diagnose)
        self._heartbeat = 0
        self._frozen: list[_Record] = []

    def __enter__(self) -> ProgressWatchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self, step: int | None = None) -> None:
        """Record progress (working on ``step``); cheap: the thread publishes it."""
        self._beats += 1
        if step is not None:
            self._step = int(step)
        self._last_beat = time.monotonic()

    def start(self) -> None:
        """Connect to the job's store and start the thread (a no-op when the job has no store address)."""
        global _starts
        _starts += 1
        if self._thread is not None:
            return
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(30.0, self.interval_s * 4)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(f"{PREFIX}/{attempt}/{_starts}/", store)
        self._stop.clear()
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="progress-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the store keeps the last record)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        self._store = None

    # -- the thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._publish()
            if self._stop.wait(self.interval_s):
                return
            if time.monotonic() - self._last_beat > self.timeout_s and not self._stop.is_set():
                try:
                    message = self.diagnose()
                except Exception as err:  # noqa: BLE001 - the store's host (rank 0, or the agent) is the one stuck
                    message = (f"the job's key-value store at {os.environ.get('MASTER_ADDR')}:"
                               f"{os.environ.get('MASTER_PORT')} does not answer ({type(err).__name__}): the process "
                               f"hosting it (rank 0 or the launcher) stopped; no progress for {self.timeout_s:g} s "
                               "(ddp_timeout)")
                self._end_job(message)

    def _publish(self) -> None:
        """Publish this rank's progress with the next heartbeat; a store that does not answer is diagnosed later,
        if it matters."""
        self._heartbeat += 1
        record = {"beats": self._beats, "step": self._step, "heartbeat": self._heartbeat, "host": socket.gethostname(),
                  "pid": os.getpid()}
        with contextlib.suppress(Exception):
            self._store.set(f"rank{self.rank}", json.dumps(record))

    def _records(self) -> dict[int, _Record | None]:
        out: dict[int, _Record | None] = {}
        for rank in range(self.world_size):
            key = f"rank{rank}"
            out[rank] = _Record(**json.loads(self._store.get(key))) if self._store.check([key]) else None
        return out

    def diagnose(self) -> str:
        """One line naming the rank(s) this job waits for (reads every rank's record twice, heartbeats apart)."""
        before = self._records()
        for _ in range(_HEARTBEATS_WATCHED):  # the others diagnose too: keep beating while watching them
            self._stop.wait(self.interval_s)
            self._publish()
        after = self._records()
        waited = f"{self.timeout_s:g} s"
        frozen = [r for r in range(self.world_size) if r != self.rank
                  and (after[r] is None or before[r] is None or after[r].heartbeat == before[r].heartbeat)]
        self._frozen = [after[r] for r in frozen if after[r] is not None]
        after[self.rank] = _Record(self._beats, self._step, self._heartbeat, socket.gethostname(), os.getpid())
        alive = [r for r in range(self.world_size) if r not in frozen]
        self._reporter = min(alive, default=self.rank)
        if frozen:
            where = ", ".join(_describe(r, after[r]) for r in frozen)
            silent = _HEARTBEATS_WATCHED * self.interval_s
            others = f"; {_ranks(alive)} {_wait(alive)} at step {max(after[r].step for r in alive)}" if alive else ""
            return (f"{_ranks(frozen)} did not arrive: no heartbeat for {silent:.1f} s (stopped, frozen or its host is "
                    f"gone: {where}){others}; no progress for {waited} (ddp_timeout)")
        lowest = min(after[r].beats for r in alive)
        behind = [r for r in alive if after[r].beats == lowest]
        if len(behind) < len(alive):
            ahead = [r for r in alive if r not in behind]
            first = behind[0]
            return (f"{_ranks(behind)} did not arrive: stuck at step {after[first].step} ({_describe(first, after[first])}) "
                    f"while {_ranks(ahead)} {_wait(ahead)} at step {max(after[r].step for r in ahead)}; no progress for "
                    f"{waited} (ddp_timeout)")
        return (f"all {len(alive)} ranks wait at step {after[alive[0]].step} and none can go on (a deadlocked "
                f"collective, or a step longer than ddp_timeout); no progress for {waited} (ddp_timeout)")

    def _end_job(self, message: str) -> None:
        """Report ``message`` (torchelastic's error file; stderr from the lowest live rank) and exit with status 1."""
        error = ProgressTimeoutError(message)
        try:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(error)
        except Exception:  # noqa: BLE001 - reporting must not stop the exit
            pass
        if self.rank == self._reporter:
            print(f"error: {message}", file=sys.stderr, flush=True)
        # A stopped process cannot take the launcher's SIGTERM (torch waits 30 s before it kills it): continue the
        # frozen ranks of this host, so they end with the job now.
        for record in self._frozen:
            if record.host == socket.gethostname():
                with contextlib.suppress(OSError):
                    os.kill(record.pid, signal.SIGCONT)
        sys.stdout.flush()
        os._exit(1)


def _wait(ranks: list[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _describe(rank: int, record: _Record | None) -> str:
    if record is None:
        return f"rank {rank} never reported"
    return f"rank {rank}: pid {record.pid} on {record.host}, last at step {record.step}"
