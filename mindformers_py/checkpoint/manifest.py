"""A checkpoint's manifest: every file it holds with its size and SHA-256, written last, checked before resuming.

``manifest.json`` is written into a checkpoint folder after every other file, just before the folder is renamed to its
final name, so a folder with a manifest was complete when it was written. :func:`verify_manifest` finds what happened
to it since: a file missing, cut short or changed (a disk that filled up under another program, a copy interrupted
half way, bit rot) is named in one line, and a resumed run refuses the checkpoint instead of loading damaged state.
The checksums are the ``sha256sum`` ones, so ``sha256sum -c`` style tools check a folder too.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from ..errors import CheckpointError

MANIFEST_NAME = "manifest.json"
_CHUNK = 8 * 2**20


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` (relative POSIX paths, sorted), the manifest itself excluded."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str | os.PathLike) -> Path:
    """Write ``manifest.json`` listing every file of ``folder`` with its size and SHA-256; returns its path."""
    folder = Path(folder)
    names = _files(folder)
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:  # hashlib frees the GIL
        digests = list(pool.map(lambda rel: file_sha256(folder / rel), names))
    files = {rel: {"size": (folder / rel).stat().st_size, "sha256": digest} for rel, digest in zip(names, digests)}
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def has_manifest(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` carries a manifest (checkpoints written before manifests existed do not)."""
    return (Path(folder) / MANIFEST_NAME).is_file()


def read_manifest(folder: str | os.PathLike) -> dict[str, dict[str, object]]:
    """``{relative path: {"size": int, "sha256": str}}`` of ``folder``'s manifest; a damaged manifest is refused."""
    path = Path(folder) / MANIFEST_NAME
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
        return files
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path.parent} is damaged: its {MANIFEST_NAME} cannot be read ({err})") from None


def manifest_problem(folder: str | os.PathLike, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with ``folder`` against its manifest, in one line, or None when it matches.

    Every listed file must exist with its size; with ``checksums`` the files of this caller's ``share`` (``(index,
    count)``: every ``count``-th file from ``index``, so the ranks of a job split the reading) must have their
    SHA-256. A checkpoint without a manifest has nothing to check (None).
    """
    folder = Path(folder)
    if not has_manifest(folder):
        return None
    try:
        files = read_manifest(folder)
    except CheckpointError as err:
        return str(err)
    names = sorted(files)
    for rel in names:
        path = folder / rel
        expected = int(files[rel]["size"])
        if not path.is_file():
            return f"checkpoint {folder} is damaged: {rel} is missing (the manifest lists {expected} bytes)"
        size = path.stat().st_size
        if size != expected:
            how = "cut short" if size < expected else "longer than written"
            return f"checkpoint {folder} is damaged: {rel} is {how} ({size} bytes, the manifest says {expected})"
    if checksums:
        index, count = share
        for rel in names[index::count]:
            if file_sha256(folder / rel) != files[rel]["sha256"]:
                return f"checkpoint {folder} is damaged: {rel} does not match its checksum (changed since it was written)"
    return None


def verify_manifest(folder: str | os.PathLike, checksums: bool = True) -> None:
    """Raise a one-line CheckpointError naming the first missing, cut-short or changed file of ``folder``."""
    problem = manifest_problem(folder, checksums)
    if problem is not None:
        raise CheckpointError(problem)


def first_problem(problems: Sequence[str | None]) -> str | None:
    """The first of several callers' :func:`manifest_problem` answers that found something."""
    return next((p for p in problems if p), None)
