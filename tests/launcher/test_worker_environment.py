"""The tests' own gloo workers (``support.dist_utils.run_workers``) run in the calling test's environment and folder,
not in those of the moment the fork server started: a server started by an earlier CLI launch kept that launch's
``MINDFORMERS_PY_LAYOUT``, and later matrix workers ran the handed-over layout instead of the one they asked for."""

from __future__ import annotations

import os

from support.dist_utils import run_workers


def _environment(rank: int, world_size: int) -> tuple[str | None, str | None, str]:
    return os.environ.get("HOME"), os.environ.get("MF_TEST_SET_NOW"), os.getcwd()


def test_a_worker_sees_the_callers_environment_and_folder_as_they_are_now(tmp_path, monkeypatch):
    run_workers(_environment, 1)  # the fork server runs (if no earlier test started it) before anything changes
    monkeypatch.delenv("HOME")  # set when any fork server started: must not come back from it
    monkeypatch.setenv("MF_TEST_SET_NOW", "yes")
    monkeypatch.chdir(tmp_path)
    assert run_workers(_environment, 1) == [(None, "yes", str(tmp_path))]
