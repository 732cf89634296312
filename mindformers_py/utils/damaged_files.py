"""One line saying what is wrong with a damaged file in a model folder, for the errors that transformers' and
tokenizers' loaders raise (a config, tokenizer or processor JSON file that does not parse), instead of a reader's
traceback. Damaged safetensors weights are diagnosed by the checkpoint wing
(:func:`mindformers_py.checkpoint.safetensors_io.unreadable_safetensors`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointError


def damaged_json_file(folder: Path) -> str | None:
    """One line naming the first ``*.json`` file of ``folder`` that is not valid JSON (where a tokenizer or processor
    failed to load), or None."""
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"{path.name} in {folder} is not valid JSON ({err}); fix it or save the file again"
    return None


@contextlib.contextmanager
def loading_from(folder: str | os.PathLike, what: str, hint: str = "") -> Iterator[None]:
    """Turn a loader's error about ``folder`` (transformers' and tokenizers' readers raise OSError, ValueError or a
    JSON error) into one CheckpointError line: the damaged JSON file when there is one, else ``what`` could not be
    loaded, with the reader's first line and ``hint``."""
    try:
        yield
    except (OSError, ValueError, TypeError) as err:
        damaged = damaged_json_file(Path(folder))
        if damaged is not None:
            raise CheckpointError(damaged) from None
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"no {what} could be loaded from {folder} ({first}){'; ' + hint if hint else ''}") from None
