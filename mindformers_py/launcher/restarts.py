"""Restarts of a launched job as its workers see them: how many, why, and when the failure happened.

:func:`~mindformers_py.launcher.launch.launch` (``max_restarts``) restarts the whole worker group when one worker
fails; before each restart its agent appends the cause to a file named by :data:`RESTART_LOG_ENV`, which the
restarted workers inherit. :func:`restart_info` reads it (and torchelastic's ``TORCHELASTIC_RESTART_COUNT``), so a
restarted Trainer knows to resume from its latest checkpoint and can log what happened. Kept free of torch imports:
the Trainer reads it at every ``train()``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

RESTART_LOG_ENV = "MINDFORMERS_RESTART_LOG"
"""Environment variable naming the file where :func:`~mindformers_py.launcher.launch.launch`'s agent appends one JSON line per restart (the cause and
when the failure was seen); the restarted workers read the last line (:func:`restart_info`)."""


@dataclass(frozen=True)
class RestartInfo:
    """Why and when the worker group this process belongs to was restarted."""

    count: int
    """Restarts so far (torchelastic's ``TORCHELASTIC_RESTART_COUNT``; >= 1)."""
    cause: str
    """What failed (``rank 1 of the job failed with exit code -9 (SIGKILL)``), or a note that the launcher did not
    say (a restart by a torchrun started outside this package)."""
    failed_at: float | None
    """``time.time()`` when the agent saw the failure (None when unknown)."""


def restart_info(environ: dict[str, str] | None = None) -> RestartInfo | None:
    """This worker's :class:`RestartInfo` when the elastic agent restarted its group, else None."""
    env = os.environ if environ is None else environ
    count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count < 1:
        return None
    cause, failed_at = "restarted by the launcher (its log says why)", None
    log = env.get(RESTART_LOG_ENV)
    if log and os.path.isfile(log):
        with open(log, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        if lines:
            last = json.loads(lines[-1])
            cause, failed_at = last["cause"], last["failed_at"]
    return RestartInfo(count=count, cause=cause, failed_at=failed_at)
