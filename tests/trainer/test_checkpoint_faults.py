"""Checkpoints under faults, one process: every checkpoint carries a manifest that resuming checks (a file cut short,
changed or missing is refused naming it; "latest" passes over a damaged checkpoint to the one before, leaving it in
place); a disk that fills up (a small tmpfs) stops the run in one line with no partial checkpoint and the earlier ones
intact, and the run resumes once space is freed; asynchronous saves train on the same losses, leave complete folders
only and report a failed write at the next step."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from transformers import TrainerCallback

from mindformers_py.checkpoint.background_writer import CheckpointWriter
from mindformers_py.errors import CheckpointError
from mindformers_py.trainer import Trainer
from mindformers_py.checkpoint.manifest import MANIFEST_NAME, file_sha256, read_manifest
from mindformers_py.checkpoint.safetensors_io import atomic_folder
from test_trainer import args, tiny_gpt, token_data, train_losses

RUN = dict(max_steps=4, save_strategy="steps", save_steps=2)


def _train(folder: Path, resume=None, callbacks=(), **kw) -> Trainer:
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(folder.parent, folder.name, **{**RUN, **kw}),
                      callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One run with checkpoint-2 and checkpoint-4 (written synchronously) and its losses."""
    folder = tmp_path_factory.mktemp("saved") / "run"
    return folder, train_losses(_train(folder).state)


def _copy(saved_folder: Path, tmp_path: Path, *names: str) -> Path:
    run = tmp_path / "run"
    for name in names:
        shutil.copytree(saved_folder / name, run / name)
    return run


def test_every_checkpoint_lists_its_files_sizes_and_checksums(saved):
    folder, _ = saved
    for name in ("checkpoint-2", "checkpoint-4"):
        files = read_manifest(folder / name)
        on_disk = sorted(p.relative_to(folder / name).as_posix() for p in (folder / name).rglob("*")
                         if p.is_file() and p.name != MANIFEST_NAME)
        assert sorted(files) == on_disk and "model.safetensors" in files and "optimizer.pt" in files
        for rel, entry in files.items():
            assert entry["size"] == (folder / name / rel).stat().st_size
            assert entry["sha256"] == file_sha256(folder / name / rel)


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "cut_short": (lambda c: _cut(c / "model.safetensors"), r"checkpoint-4 is damaged: model.safetensors is cut short"),
    "changed": (lambda c: _flip(c / "optimizer.pt"), r"optimizer.pt does not match its checksum"),
    "missing": (lambda c: (c / "rng_state.pth").unlink(), r"rng_state.pth is missing"),
    # Checkpoints written before manifests existed are still checked file by file while loading.
    "no_manifest": (lambda c: ((c / MANIFEST_NAME).unlink(), (c / "optimizer.pt").write_bytes(b"not a torch file")),
                    r"optimizer file .*checkpoint-4/optimizer.pt is damaged"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, damage):
    run = _copy(saved[0], tmp_path, "checkpoint-4")
    hurt, pattern = DAMAGES[damage]
    hurt(run / "checkpoint-4")
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, **RUN))
    with pytest.raises(CheckpointError, match=pattern) as err:
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    assert "\n" not in str(err.value)


def test_latest_passes_over_a_damaged_checkpoint_and_leaves_it(saved, tmp_path, caplog):
    folder, losses = saved
    run = _copy(folder, tmp_path, "checkpoint-2", "checkpoint-4")
    _cut(run / "checkpoint-4" / "optimizer.pt")
    resumed = _train(run, resume=True, max_steps=3)
    assert train_losses(resumed.state) == {s: losses[s] for s in (1, 2, 3)}  # from checkpoint-2, exactly
    assert "checkpoint-4 is damaged: optimizer.pt is cut short" in caplog.text
    assert (run / "checkpoint-4" / MANIFEST_NAME).is_file()  # reported, not deleted


# -- a full disk ---------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs the right to mount, as root in this sandbox; skipped elsewhere: the translation of a write's
    ENOSPC is tested without it below)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


class FillDisk(TrainerCallback):
    """After step 3, fills the output folder's filesystem up to ``leave`` free bytes."""

    def __init__(self, leave: int) -> None:
        self.leave = leave

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            # An asynchronous checkpoint-2 may still be writing: fill the disk only once it is complete (it appears
            # under its final name then), so the save that runs out of space is checkpoint-4's, every time.
            deadline = time.monotonic() + 120
            while not (Path(args.output_dir) / "checkpoint-2").is_dir() and time.monotonic() < deadline:
                time.sleep(0.02)
            free = shutil.disk_usage(args.output_dir).free
            (Path(args.output_dir).parent / "filler").write_bytes(b"\0" * max(0, free - self.leave))


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_once_space_is_freed(saved, small_disk, save_async,
                                                                                  monkeypatch):
    folder, losses = saved
    run = small_disk / "run"
    if save_async:  # no estimate: the background write itself runs out of space half way
        monkeypatch.setattr("mindformers_py.engine.base.Engine.checkpoint_bytes", lambda self, model, optimizer: 0)
    with pytest.raises(CheckpointError) as err:
        _train(run, callbacks=[FillDisk(leave=64 * 1024)], save_async=save_async)
    message = str(err.value)
    assert f"no space left for checkpoint {run / 'checkpoint-4'}" in message and "\n" not in message
    assert ("needs about" in message) != save_async and "earlier checkpoints are intact" in message
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]  # no partial folder
    assert read_manifest(run / "checkpoint-2")  # intact: resuming checks it below
    (small_disk / "filler").unlink()
    resumed = _train(run, resume=True, save_async=save_async)
    assert train_losses(resumed.state) == losses


def test_a_write_that_runs_out_of_space_names_the_folder_and_leaves_nothing(tmp_path):
    with pytest.raises(CheckpointError, match=r"no space left for checkpoint .*checkpoint-9: it needs about 1.0 MiB"):
        with atomic_folder(tmp_path / "checkpoint-9", manifest=True, needed_bytes=2**20) as tmp:
            (tmp / "part").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


# -- asynchronous saves --------------------------------------------------------------------------------------------


def test_async_saves_train_on_the_same_losses_and_leave_complete_checkpoints(saved, tmp_path):
    folder, losses = saved
    run = tmp_path / "run"
    trainer = _train(run, save_async=True)
    assert train_losses(trainer.state) == losses
    for name in ("checkpoint-2", "checkpoint-4"):  # both complete when train() returned, manifests included
        assert {p.name for p in (run / name).iterdir()} == {p.name for p in (folder / name).iterdir()}
        assert read_manifest(run / name)["model.safetensors"] == read_manifest(folder / name)["model.safetensors"]
    assert not list(run.glob(".checkpoint-*"))
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 4


def test_one_background_save_at_a_time_and_its_error_surfaces():
    writer, order, release = CheckpointWriter(), [], threading.Event()

    def slow():
        release.wait(10)
        order.append("first")

    start = time.perf_counter()
    writer.submit("first", slow)
    assert time.perf_counter() - start < 1 and writer.in_flight  # submitting does not wait for the write
    threading.Timer(0.2, release.set).start()
    writer.submit("second", lambda: order.append("second"))  # waits for the first
    writer.wait()
    assert order == ["first", "second"]
    writer.submit("broken", lambda: (_ for _ in ()).throw(CheckpointError("disk gone")))
    time.sleep(0.1)
    with pytest.raises(CheckpointError, match="disk gone"):
        writer.raise_if_failed()
    writer.close()


def test_leftovers_of_a_save_killed_half_way_are_cleaned_up(tmp_path):
    """A kill while writing leaves a temporary folder (removed); one between the two renames of a replaced checkpoint
    leaves the old version aside (put back)."""
    from mindformers_py.trainer.checkpoint import checkpoint_folders, remove_partial_checkpoints

    (tmp_path / ".checkpoint-4.tmp-abc").mkdir()
    (tmp_path / ".checkpoint-2.old-123").mkdir()
    (tmp_path / ".checkpoint-2.old-123" / "marker").write_text("old")
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / ".checkpoint-6.old-9").mkdir()
    assert remove_partial_checkpoints(tmp_path) == [tmp_path / ".checkpoint-4.tmp-abc"]
    assert [p.name for p in checkpoint_folders(tmp_path)] == ["checkpoint-2", "checkpoint-6"]
    assert (tmp_path / "checkpoint-2" / "marker").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6"]
