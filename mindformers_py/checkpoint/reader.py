"""Reading a safetensors checkpoint folder one tensor at a time, without loading it.

A folder holds ``model.safetensors`` or HF-style shards listed in ``model.safetensors.index.json``. Only the headers
are read up front (names, shapes, dtypes); :meth:`CheckpointReader.tensor` returns a tensor that is a view of the
memory-mapped file (safetensors maps it privately: nothing is read from disk until the values are touched, and
writing to the view never changes the file). So a caller that copies only a slice of a tensor reads only that slice's
pages, and one that keeps the view as a parameter (same dtype, on the CPU) holds no second copy of it, as
transformers' own loader does.

Damaged or missing files are one-line :class:`~mindformers_py.errors.CheckpointError`\\ s naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from .safetensors_io import SAFETENSORS_DTYPES, unreadable_safetensors, weight_files

class CheckpointReader:
    """The tensors of a safetensors checkpoint folder by name, read lazily (see the module docstring).

    Use as a context manager (or call :meth:`close`): the files stay open until then. Tensors handed out stay valid
    after closing (each keeps its file's mapping alive for as long as it lives)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.files = weight_files(self.folder)  # the index's shards, or model.safetensors
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._offset: dict[str, int] = {}  # where each tensor's bytes start in its file
        for path in self.files:
            for key, (shape, dtype, offset) in _read_header(path).items():
                self._where[key] = path
                self._meta[key] = (shape, dtype)
                self._offset[key] = offset
        self._open: dict[Path, Any] = {}

    # -- what the checkpoint holds (headers only) ---------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``."""
        return self._meta[key][0]

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key``."""
        return self._meta[key][1]

    def meta_tensor(self, key: str) -> torch.Tensor:
        """An empty tensor on the ``meta`` device with ``key``'s shape and dtype (for planning without reading)."""
        shape, dtype = self._meta[key]
        return torch.empty(shape, dtype=dtype, device="meta")

    def floating_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor (what ``dtype="auto"`` loads a checkpoint in when its config
        names none), or None."""
        return next((dtype for _, dtype in self._meta.values() if dtype.is_floating_point), None)

    # -- values ---------------------------------------------------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        """``key``'s tensor as a view of the mapped file (CPU, stored dtype); nothing is read until it is touched."""
        path = self._where[key]
        handle = self._open.get(path)
        try:
            if handle is None:
                handle = self._open[path] = safe_open(str(path), framework="pt", device="cpu")
            return handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(unreadable_safetensors(path, e)) from None

    def read_rows(self, key: str, start: int, out: torch.Tensor) -> None:
        """Read rows ``start .. start + len(out)`` of ``key`` (along its first dimension: contiguous bytes in the file)
        straight into ``out`` (a contiguous CPU tensor of ``key``'s dtype and row shape) with plain file reads, so
        the process maps no page of the file and holds no copy beyond ``out``."""
        shape, dtype = self._meta[key]
        if out.dtype != dtype or tuple(out.shape[1:]) != tuple(shape[1:]) or not out.is_contiguous() or \
                out.device.type != "cpu" or start + out.shape[0] > shape[0]:
            raise ValueError(f"{key}: cannot read rows {start}..{start + out.shape[0]} of {shape} {dtype} into "
                             f"{tuple(out.shape)} {out.dtype}")
        row_bytes = out[0].numel() * out.element_size() if out.shape[0] else 0
        path = self._where[key]
        target = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(self._offset[key] + start * row_bytes)
                done = 0
                while done < len(target):
                    n = f.readinto(target[done:])
                    if not n:
                        raise OSError("unexpected end of file")
                    done += n
        except OSError as e:
            raise CheckpointError(unreadable_safetensors(path, e)) from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, lazy view) of every tensor."""
        for key in self._where:
            yield key, self.tensor(key)

    def close(self) -> None:
        """Close the files (tensors already handed out stay valid)."""
        self._open.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """name -> (shape, dtype, where its bytes start in the file) from a safetensors file's header alone; a damaged
    file is one CheckpointError line."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 0 < length <= size - 8:
                raise ValueError("header too large or missing")
            header = json.loads(f.read(length))
        out: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
        end = 0
        for key, info in header.items():
            if key == "__metadata__":
                continue
            out[key] = (tuple(info["shape"]), SAFETENSORS_DTYPES[info["dtype"]], 8 + length + info["data_offsets"][0])
            end = max(end, info["data_offsets"][1])
        if size < 8 + length + end:
            raise ValueError("incomplete file")
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(unreadable_safetensors(path, e)) from None
