"""Where training checkpoints live and what the Trainer itself writes into them.

A checkpoint is ``<output_dir>/checkpoint-<step>/``: the engine writes weights, optimizer, scheduler and RNG
states (:meth:`Engine.save_checkpoint`), the Trainer adds ``trainer_state.json`` (HF's ``TrainerState``),
``data_state.json`` (the data position, :class:`DataPosition`) and ``training_args.json``. The folder is written
under a temporary name and renamed when complete, so a ``checkpoint-<step>`` folder is never half written, and
carries a manifest (every file's size and checksum) that resuming checks, so one damaged since is refused or, when
resuming from the latest, passed over for the one before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerState

from ..adapters.files import is_adapter_folder
from ..errors import CheckpointError, MindFormersError
from ..checkpoint.manifest import manifest_problem
from ..checkpoint.safetensors_io import has_weights

CHECKPOINT_PREFIX = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
DATA_STATE_NAME = "data_state.json"
ARGS_NAME = "training_args.json"
LOG_NAME = "log.jsonl"
CURVE_NAME = "loss_curve.png"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


@dataclass
class DataPosition:
    """How far training has read the data: the epoch and the samples of it already consumed.

    Samples (not batches) are stored so a run resumed with another batch size still skips what was used; with
    the same batch size the skip is exact.
    """

    epoch: int = 0
    """Epoch being read (0-based)."""
    samples_consumed: int = 0
    """Samples of that epoch already used (global, over all data-parallel ranks)."""
    num_samples: int = 0
    """Length of the training dataset when the checkpoint was written."""
    global_batch_size: int = 0
    """Samples per global micro-batch when the checkpoint was written."""
    data_seed: int = 0
    """Seed of the per-epoch shuffles."""

    def to_json(self) -> str:
        """The position as JSON text."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, folder: Path) -> DataPosition:
        """The position saved in checkpoint ``folder``."""
        data = _read_json(folder / DATA_STATE_NAME, "data position")
        try:
            return cls(**{k: int(data[k]) for k in ("epoch", "samples_consumed", "num_samples", "global_batch_size",
                                                     "data_seed")})
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"data position file {folder / DATA_STATE_NAME} is damaged ({err!r})") from None


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Complete ``checkpoint-<step>`` folders of ``output_dir``, oldest (lowest step) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | bool | None, output_dir: str | Path, check: Callable[[Path], str | None] | None = None,
                   restarted: bool = False) -> tuple[Path | None, list[str]]:
    """The checkpoint folder to resume from, and what was wrong with newer ones that were passed over.

    ``resume``: None/False (a fresh run), True (the latest checkpoint in ``output_dir`` that passes ``check``) or a
    folder (which must pass). ``restarted`` (the launcher restarted this run): the latest passing checkpoint in
    ``output_dir``, else ``resume``. ``check(folder)`` says in one line what is wrong with a folder (default: its
    manifest, :func:`~mindformers_py.checkpoint.manifest.manifest_problem`), or None. Damaged checkpoints are reported,
    never deleted; a damaged or missing folder that was asked for by name is refused in one line."""
    check = check or manifest_problem
    skipped: list[str] = []
    if restarted or resume is True:
        for folder in reversed(checkpoint_folders(output_dir)):
            problem = check(folder)
            if problem is None:
                return folder, skipped
            skipped.append(problem)
        if resume is True:
            why = f" that passes its check ({'; '.join(skipped)})" if skipped else ""
            raise CheckpointError(f"resume_from_checkpoint=True but {output_dir} holds no {CHECKPOINT_PREFIX}-<step> "
                                  f"folder to resume from{why}")
    if resume is None or resume is False or resume is True:
        return None, skipped
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={str(resume)!r}: no such checkpoint folder")
    problem = check(path)
    if problem is not None:
        raise CheckpointError(problem)
    return path, skipped


def check_checkpoint(folder: Path, engine_files: list[str]) -> None:
    """Refuse a checkpoint folder that lacks weights, engine state or the Trainer's files."""
    if not has_weights(folder) and not is_adapter_folder(folder):
        raise CheckpointError(f"checkpoint {folder} is incomplete: no model weights (model.safetensors)")
    for name in [TRAINER_STATE_NAME, DATA_STATE_NAME, *engine_files]:
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing")


def read_trainer_state(folder: Path) -> TrainerState:
    """The ``TrainerState`` saved in checkpoint ``folder``."""
    path = folder / TRAINER_STATE_NAME
    _read_json(path, "trainer state")
    try:
        return TrainerState.load_from_json(str(path))
    except TypeError as err:
        raise CheckpointError(f"trainer state file {path} is damaged ({err})") from None


def save_trainer_state(state: TrainerState, output_dir: str | Path) -> Path:
    """Write ``state`` to ``<output_dir>/trainer_state.json`` with ``TrainerState.save_to_json``, through a
    temporary file so a reader never sees a half-written state."""
    path = Path(output_dir) / TRAINER_STATE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    state.save_to_json(str(tmp))
    os.replace(tmp, path)
    return path


def rotate_checkpoints(output_dir: str | Path, limit: int | None, keep: list[Path] = ()) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``, never one in ``keep`` (the newest, the best); returns
    the deleted folders."""
    if limit is None:
        return []
    folders = checkpoint_folders(output_dir)
    kept = {Path(p).resolve() for p in keep}
    excess = len(folders) - max(limit, len(kept))
    doomed = [p for p in folders if p.resolve() not in kept][:max(0, excess)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Clean up after a process killed while it saved a checkpoint: remove the temporary folders of saves that never
    finished (``.checkpoint-<step>.tmp-*``: nothing of them is under a final name), and put back a checkpoint that was
    being replaced (``.checkpoint-<step>.old-*``) when its new version never took its name. Returns what was removed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    for backup in root.glob(f".{CHECKPOINT_PREFIX}-*.old-*"):
        final = root / backup.name[1:].split(".old-")[0]
        if final.exists():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(backup, final)
    partial = [p for p in root.glob(f".{CHECKPOINT_PREFIX}-*.tmp-*") if p.is_dir()]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def check_output_dir(output_dir: str | Path, overwrite: bool | None) -> list[Path]:
    """What of another run ``output_dir`` holds (its checkpoints and trainer state), writing nothing; with
    ``overwrite=False`` a folder holding another run is refused. A new folder is the first way out offered:
    overwriting deletes that run's checkpoints (a LoRA recipe may be reading its model)."""
    root = Path(output_dir)
    previous = [p for p in checkpoint_folders(root)] + [p for p in (root / TRAINER_STATE_NAME,) if p.exists()]
    if previous and overwrite is False:
        names = ", ".join(p.name for p in previous[:3]) + (", ..." if len(previous) > 3 else "")
        raise MindFormersError(
            f"output_dir={str(root)!r} holds another run ({names}); give this run a new output_dir (--output_dir "
            "runs/<new name>), continue that run with resume_from_checkpoint=True, or delete its checkpoints and "
            "train over it with overwrite_output_dir=True"
        )
    return previous


def prepare_output_dir(output_dir: str | Path, overwrite: bool | None, logging_dir: str | Path | None) -> None:
    """Make ``output_dir`` ready for a fresh run. If it holds another run's checkpoints or state: ``overwrite=False``
    refuses (:func:`check_output_dir`), ``True`` removes those files (checkpoints, state, log, curve, TensorBoard
    events under ``logging_dir``) first, None trains over them as transformers 5 does (the new run rewrites the
    state, log and curve). Other files are left alone."""
    root = Path(output_dir)
    previous = check_output_dir(root, overwrite)
    if previous and overwrite:
        for path in checkpoint_folders(root):
            shutil.rmtree(path)
        if logging_dir is not None and Path(logging_dir).is_dir():
            for events in Path(logging_dir).glob("events.out.tfevents.*"):
                events.unlink()
    if previous:  # a fresh run starts its own state, log and curve
        for name in (TRAINER_STATE_NAME, LOG_NAME, CURVE_NAME):
            (root / name).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent} is incomplete: {what} file {path.name} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{what} file {path} is damaged (not valid JSON: {err})") from None


def pretrained_state(model: Any, folder: str | Path) -> dict[str, Any]:
    """The weights of a ``save_pretrained`` folder keyed for ``model``. For our model families an HF checkpoint
    of a covered architecture (e.g. GPT-2) is converted on the fly, as ``AutoModelForCausalLM`` does."""
    from ..models import registry
    from ..checkpoint.safetensors_io import load_state_dict

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"finetune_checkpoint={str(folder)!r}: no such checkpoint folder")
    state = load_state_dict(folder)
    config = getattr(model, "config", None)
    family = registry.family_for_model_type(getattr(config, "model_type", None) or "")
    if family is None or family.converter is None or not isinstance(config, family.config_class):
        return state
    raw = _read_json(folder / "config.json", "model config") if (folder / "config.json").is_file() else {}
    if raw.get("model_type") in family.hf_types:
        state = family.converter.state_dict_from_hf(state, config)
    return state
