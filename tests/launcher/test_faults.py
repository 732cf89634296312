"""Faults in launched jobs, injected for real: a rank SIGKILLed at a random step is restarted by the launcher
(``max_restarts``) and the run resumes by itself, its logged losses equal to an uninterrupted run's bit for bit
under dp2, tp2 and pp2; a rank that stops (SIGSTOP) or deadlocks in a collective ends the job within ``ddp_timeout``,
naming it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from support.dist_utils import _PRELOAD
from support.fault_workers import STEPS, Fault, hangs, killed_and_restarted, read_log, train
from mindformers_py.launcher.launch import LaunchError, launch


def _launch(fn, *args, **kwargs):
    # Workers fork from one server that imported torch, transformers and the package once (as run_workers' do).
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return launch(fn, 2, *args, start_method="forkserver", **kwargs)


def _losses(history: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_a_killed_rank_is_restarted_and_the_run_resumes_exactly(tmp_path, layout):
    rank, step = random.randrange(2), random.randrange(1, STEPS)  # any rank, any step: the outcome must not care
    results = _launch(killed_and_restarted, layout, str(tmp_path), rank, step, max_restarts=1)
    where = f"{layout}, rank {rank} killed after step {step}"
    for result in results.values():
        assert result["attempt"] == 1, where  # the group was restarted once
        faulty, reference = _losses(result["faulty"]), _losses(result["reference"])
        assert sorted(reference) == list(range(1, STEPS + 1))
        assert faulty == reference, where  # bit for bit: same data order, RNG, optimizer and scheduler state
    restarts = [e for e in results[0]["faulty"] if "restart" in e]
    assert len(restarts) == 1 and f"rank {rank} of the job failed with exit code -9 (SIGKILL)" in restarts[0]["restart_cause"]
    resumed = restarts[0]["resumed_from"]
    assert resumed in (None, *(f"checkpoint-{s}" for s in range(2, step + 1, 2))), (where, resumed)
    assert restarts[0]["restart_seconds"] > 0
    print(f"{where}: resumed from {resumed} {restarts[0]['restart_seconds']} s after the kill")
    state = json.loads(Path(tmp_path, "faulty", "trainer_state.json").read_text())
    assert [e["restart_cause"] for e in state["log_history"] if "restart" in e] == [restarts[0]["restart_cause"]]
    assert [e["restart"] for e in read_log(str(tmp_path / "faulty")) if "restart" in e] == [1]
    assert not list(Path(tmp_path, "faulty").glob(".checkpoint-*"))  # no temporary folder of the killed save left


# What each hang may be reported as. A stopped rank's heartbeat stops, so it is named. A deadlocked rank keeps beating:
# it is named as the one behind when the others got further, but whether they did before blocking depends on the
# machine's speed, and when every rank waits at the same step the watchdog can only say that none can go on.
HANG_REPORTS = {"stop": ("rank 1 did not arrive",),
                "deadlock": ("rank 1 did not arrive", "all 2 ranks wait at step 2 and none can go on")}


@pytest.mark.parametrize("how", ["stop", "deadlock"])
def test_a_rank_that_hangs_ends_the_job_naming_it(tmp_path, how):
    """The job ends by the progress watchdog after ddp_timeout (2 s here, not the collectives' backstop), with one
    ProgressTimeoutError line saying which rank it waits for, or that all wait."""
    with pytest.raises(LaunchError) as err:
        _launch(hangs, how, str(tmp_path), 2)
    message = str(err.value)
    assert "ProgressTimeoutError" in message and "no progress for 2 s (ddp_timeout)" in message, message
    assert any(report in message for report in HANG_REPORTS[how]), message


def test_the_trainers_own_workers_restart_and_resume_exactly(tmp_path):
    """A Trainer started from Python with a dp2 layout launches its workers itself; with ``max_restarts`` a killed
    worker is restarted and the call still returns the uninterrupted run's losses, with the restart in its state.
    Synchronous saves here, so checkpoint-2 is surely complete when rank 1 dies after step 3."""
    faulty = train("dp2", str(tmp_path / "faulty"), Fault("kill", rank=1, step=3), max_restarts=1)
    reference = train("dp2", str(tmp_path / "reference"), save_strategy="no")
    assert sorted(_losses(reference)) == list(range(1, STEPS + 1))
    assert _losses(faulty) == _losses(reference)
    restarts = [e for e in faulty if "restart" in e]
    assert len(restarts) == 1 and restarts[0]["resumed_from"] == "checkpoint-2", restarts
    assert "rank 1 of the job failed with exit code -9 (SIGKILL)" in restarts[0]["restart_cause"]
