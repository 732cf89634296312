"""Writing a checkpoint tensor by tensor into size-bounded safetensors shards, as transformers' ``save_pretrained``
lays them out (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``).

Each file's header (names, dtypes, shapes, offsets) is known before any value is read, so it is written first and the
tensors follow one at a time as they are fetched: the writer never holds more than one tensor, whatever the size of
the model or of a shard (transformers' default ``max_shard_size`` of 50 GB is one file for most models).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..errors import ConfigError
from .safetensors_io import INDEX_NAME, SAFETENSORS_DTYPES, WEIGHTS_NAME

DEFAULT_MAX_SHARD_SIZE = "50GB"
"""transformers 5's default ``max_shard_size``."""

_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


def shard_bytes(max_shard_size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a size as transformers writes it (``"5GB"`` = 5 * 10**9 bytes,
    ``"500MiB"`` = 500 * 2**20, ...)."""
    if isinstance(max_shard_size, int) and max_shard_size > 0:
        return max_shard_size
    text = str(max_shard_size).strip().upper()
    for unit, factor in _UNITS.items():
        number = text[: -len(unit)].strip()
        if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * factor)
    raise ConfigError(f"max_shard_size={max_shard_size!r} is not valid; expected a number of bytes or a size such as "
                      "'5GB', '500MB' or '2GiB'")


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The bytes a tensor of ``shape`` and ``dtype`` holds."""
    return math.prod(shape) * dtype.itemsize


def plan_shards(entries: Iterable[tuple[str, Sequence[int], torch.dtype]], max_bytes: int) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Tensors (name, shape, dtype) grouped into files of at most ``max_bytes`` each (a larger tensor gets a file of
    its own), in the given order, as transformers groups them."""
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = tensor_bytes(shape, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype))
        size += nbytes
    return shards


def _write_file(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                fetch: Callable[[str], torch.Tensor]) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = tensor_bytes(shape, dtype)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, dtype in entries:
            tensor = fetch(name).detach()
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(f"{name}: fetched {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
            data = tensor.to("cpu").contiguous().reshape(-1)
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).numpy()))
            del tensor, data


def write_shards(folder: str | os.PathLike, entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 fetch: Callable[[str], torch.Tensor], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write the tensors ``entries`` (name, shape, dtype; each value from ``fetch(name)``, one at a time) into
    ``folder`` as transformers does: one ``model.safetensors``, or shards of at most ``max_shard_size`` with
    ``model.safetensors.index.json``. Returns the file names written."""
    folder = Path(folder)
    shards = plan_shards(entries, shard_bytes(max_shard_size))
    if len(shards) == 1:
        _write_file(folder / WEIGHTS_NAME, shards[0], fetch)
        return [WEIGHTS_NAME]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(folder / name, shard, fetch)
        names.append(name)
        for key, shape, dtype in shard:
            weight_map[key] = name
            total += tensor_bytes(shape, dtype)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX_NAME]
