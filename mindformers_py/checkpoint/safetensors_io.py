"""Reading and writing state dicts as safetensors folders (single file or HF-style sharded with an index).

Only safetensors are read: no pickle of untrusted files; a file that cannot be read is named in one line saying why
(:func:`unreadable_safetensors`). Folders are written under a temporary name and renamed when complete, so an
interrupted write never leaves a half checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from .disk_space import is_out_of_space, out_of_space_error
from .manifest import write_manifest

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""The dtype names of a safetensors header -> torch dtypes (read by the lazy reader, written by the streamed writer)."""


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


def has_weights(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a safetensors checkpoint (single or sharded)."""
    folder = Path(folder)
    return (folder / WEIGHTS_NAME).is_file() or (folder / INDEX_NAME).is_file()


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index lists, or ``model.safetensors``.

    A folder may hold both. The shards are read when they are all there: a sharded save over a single-file one
    leaves the older ``model.safetensors`` behind (transformers reads that stale file; we do not). An index whose
    shards are gone beside a ``model.safetensors`` is the stale one, left by a single-file save over a sharded one
    (transformers' ``save_pretrained`` removes the shards, not the index): the single file is read. A folder without
    weights, a damaged index, or shards missing without a single file is a one-line CheckpointError."""
    folder = Path(folder)
    index, single = folder / INDEX_NAME, folder / WEIGHTS_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is damaged ({e}); re-save or re-download the checkpoint") from None
        files = [folder / name for name in names]
        absent = [path for path in files if not path.is_file()]
        if not absent:
            return files
        if not single.is_file():
            raise CheckpointError(f"{absent[0]} is listed in {INDEX_NAME} but missing")
        return [single]
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise CheckpointError(f"no weights in {folder}: expected {WEIGHTS_NAME} or {INDEX_NAME} (found: "
                          f"{', '.join(found) or 'nothing'}); only safetensors checkpoints are loaded")


def load_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors checkpoint folder (:func:`weight_files`) into one CPU state dict."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(unreadable_safetensors(path, e)) from None
    return state


def save_state_dict(state: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``state`` into ``folder`` as safetensors, sharded HF-style when larger than ``max_shard_bytes``."""
    folder = Path(folder)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


@contextlib.contextmanager
def atomic_folder(final: str | os.PathLike, overwrite: bool = True, manifest: bool = False,
                  needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success it replaces ``final``, on error it is removed.

    ``manifest`` writes ``manifest.json`` (every file's size and SHA-256, :mod:`.manifest`) last, before the rename.
    A write that runs out of disk space is reported as one CheckpointError naming ``final`` and ``needed_bytes`` (the
    temporary folder is removed first, so what is free is what the filesystem had before the save)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if manifest:
            write_manifest(tmp)
        if final.exists():
            if not overwrite:
                raise CheckpointError(f"{final} already exists; choose another destination or remove it")
            backup = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, backup)  # keep the old folder until the new one is in place
            os.replace(tmp, final)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, CheckpointError) and is_out_of_space(err):
            raise out_of_space_error(final, needed_bytes) from None
        raise
