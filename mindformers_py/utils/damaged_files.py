"""One line saying what is wrong with a damaged or foreign file in a model folder, for the errors that loading raises
instead of a reader's traceback: safetensors weights cut short or replaced by a pickle, JSON files (configs,
tokenizers) that do not parse."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointError


def unreadable_safetensors(path: Path, err: BaseException) -> str:
    """One line saying why ``path`` could not be read as safetensors: a pickle or torch zip file under that name, a
    file cut short (its header promises more bytes than it has), or the reader's own words."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
                return (f"{path} is a pickle (torch.save) file, not safetensors; pickles are never loaded (unpickling can "
                        "run code): convert it to safetensors where it came from")
            if size == 0:
                return f"{path} is empty (0 bytes): re-save or re-copy the checkpoint"
            if len(head) == 8:
                header_len = int.from_bytes(head, "little")
                if size - 8 < header_len < 2**27 and header_len % 8 == 0:  # a plausible header the file cuts into
                    return f"{path} is cut short ({size} bytes, less than its own header): re-save or re-copy the checkpoint"
                if 0 < header_len <= size - 8:
                    header = json.loads(f.read(header_len))
                    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                    expected = 8 + header_len + max(ends, default=0)
                    if size < expected:
                        return f"{path} is cut short ({size} of {expected} bytes): re-save or re-copy the checkpoint"
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass  # not even a safetensors header: the reader's message below says what it saw
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"{path} is not a readable safetensors file ({first}); re-save or re-copy the checkpoint"


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
