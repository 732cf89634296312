"""On-disk cache for artefacts built from the default corpus (tokenizers, packed datasets).

Entries are folders named by a fingerprint of everything that determines their content, so a stale
entry is never reused and a second call with the same inputs only loads from disk. Folders are written
under a temporary name and renamed when complete: an interrupted build leaves no half-written entry,
and several processes (e.g. the ranks of one launch) building the same entry at once are harmless.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

CACHE_ENV = "MINDFORMERS_PY_CACHE"
"""Environment variable that overrides the default cache folder."""


def default_cache_dir() -> Path:
    """The cache folder: ``$MINDFORMERS_PY_CACHE``, else ``$XDG_CACHE_HOME/mindformers_py``, else
    ``~/.cache/mindformers_py``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "mindformers_py"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` as a :class:`Path`, or :func:`default_cache_dir` when it is ``None``."""
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


def fingerprint(*parts: Any) -> str:
    """A short stable hex digest of JSON-serialisable ``parts`` (order matters, dict key order does not)."""
    payload = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``final``; rename it to ``final`` when the block succeeds.

    If another process renamed its own copy into place first, ours is discarded and theirs is kept
    (both were built from the same fingerprint). On an exception the temporary folder is removed.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
