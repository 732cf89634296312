"""Free space for checkpoints: refuse a save that cannot fit, and turn a disk that fills up during one into one line.

Checkpoints are written under a temporary name (:func:`~.safetensors_io.atomic_folder`), so a save that runs out of
space leaves no partial folder under a final name and earlier checkpoints are untouched; what this module adds is the
message: the folder, the space the checkpoint needs and what is free, instead of a traceback from deep inside a writer.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..errors import CheckpointError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"12.3 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(folder: str | os.PathLike) -> int:
    """Bytes free for this process on the filesystem that holds ``folder`` (or its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it, or one rank's failure inside a DCP ``CheckpointException``) is a full
    disk or an exhausted quota."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in _NO_SPACE:
            return True
        if isinstance(item, BaseException):
            if "No space left on device" in str(item):
                return True
            todo += [item.__cause__, item.__context__, getattr(item, "exception", None)]
            failures = getattr(item, "failures", None)  # torch.distributed.checkpoint's per-rank exceptions
            if isinstance(failures, dict):
                todo += list(failures.values())
    return False


def out_of_space_error(folder: str | os.PathLike, needed_bytes: int | None) -> CheckpointError:
    """The one-line error for a checkpoint ``folder`` that does not fit: what it needs and what is free."""
    folder = Path(folder)
    need = f"needs about {format_bytes(needed_bytes)}" if needed_bytes else "does not fit"
    return CheckpointError(
        f"no space left for checkpoint {folder}: it {need}, {format_bytes(free_bytes(folder.parent))} is free on that "
        "filesystem; nothing was written under its name and earlier checkpoints are intact: free space, then resume "
        "(resume_from_checkpoint=True)"
    )


def check_free_space(folder: str | os.PathLike, needed_bytes: int | None) -> None:
    """Refuse (:func:`out_of_space_error`) a checkpoint of ``needed_bytes`` that the filesystem of ``folder`` cannot
    hold, before anything is written."""
    if needed_bytes and free_bytes(Path(folder).parent) < needed_bytes:
        raise out_of_space_error(folder, needed_bytes)


def folder_bytes(folder: str | os.PathLike) -> int:
    """Total size of the files under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
