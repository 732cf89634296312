"""Which process of a run shows datasets' progress bars while a recipe prepares its data: one, not every rank.

A recipe run that needs several processes prepares its data in the launching process first (the bars show there),
then each rank prepares it again from the cache (or quickly redoes the cheap steps); those ranks keep quiet. Under
a user's own ``torchrun`` nothing was prepared before, so rank 0 shows the bars and the other ranks keep quiet.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import datasets

PROGRESS_SHOWN_ENV = "MINDFORMERS_PY_DATA_PROGRESS_SHOWN"
"""Set to ``1`` by a launching process that already showed the data preparation's progress to its workers."""


def shows_data_progress(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process shows datasets' progress bars: not when the launching process already showed them, else
    only on rank 0 (a process not started by torchrun is rank 0)."""
    env = os.environ if environ is None else environ
    if env.get(PROGRESS_SHOWN_ENV) == "1":
        return False
    return env.get("RANK", "0") == "0"


@contextlib.contextmanager
def data_progress(show: bool | None = None) -> Iterator[None]:
    """Within the block, datasets' progress bars are off unless ``show`` (default: :func:`shows_data_progress`);
    a setting the user made beforehand (bars off) is kept, and the previous state comes back afterwards."""
    show = shows_data_progress() if show is None else show
    if show or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


@contextlib.contextmanager
def progress_shown_to_workers() -> Iterator[None]:
    """Within the block, processes started from this one know its data progress was shown (they keep quiet)."""
    before = os.environ.get(PROGRESS_SHOWN_ENV)
    os.environ[PROGRESS_SHOWN_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_SHOWN_ENV, None)
        else:
            os.environ[PROGRESS_SHOWN_ENV] = before
