"""One process shows datasets' progress bars while a recipe prepares its data: the launching process (its ranks
prepare again quietly) or, under a user's torchrun, rank 0."""

from __future__ import annotations

import os

import datasets

from mindformers_py.data.progress import PROGRESS_SHOWN_ENV, data_progress, progress_shown_to_workers, \
    shows_data_progress


def test_who_shows_the_bars():
    assert shows_data_progress({}) is True  # one process, or the parent of a launch
    assert shows_data_progress({"RANK": "0"}) is True and shows_data_progress({"RANK": "1"}) is False
    assert shows_data_progress({"RANK": "0", PROGRESS_SHOWN_ENV: "1"}) is False  # the parent showed them


def test_quiet_within_the_block_only_and_a_users_choice_kept(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    datasets.enable_progress_bars()  # datasets' default
    with data_progress():
        assert datasets.are_progress_bars_disabled()
    assert not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the user turned them off: they stay off
    try:
        with data_progress(show=True):
            assert datasets.are_progress_bars_disabled()
        assert datasets.are_progress_bars_disabled()
    finally:
        datasets.enable_progress_bars()


def test_the_workers_of_a_launch_are_told(monkeypatch):
    monkeypatch.delenv(PROGRESS_SHOWN_ENV, raising=False)
    with progress_shown_to_workers():
        assert os.environ[PROGRESS_SHOWN_ENV] == "1" and not shows_data_progress()
    assert PROGRESS_SHOWN_ENV not in os.environ
