"""What the planner assumes about each rank's device: memory budget, matmul rate, memory bandwidth and link
bandwidths (:class:`DeviceSpec`), detected from the current machine, taken from the catalog of common
accelerators shipped as ``devices.yaml`` (:func:`load_device`) or set by hand; and :func:`parse_bytes` for memory
sizes given as text.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import torch
import yaml

from ..errors import ConfigError

GIB = 1024**3
# Peak dense bf16 tensor-core FLOP/s of common GPUs, matched against the device name (fp32 runs use half).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40": 181e12, "A10": 125e12, "V100": 125e12,
                  "T4": 65e12}
# Fraction of peak that large matrix products sustain in training, for GPUs missing from the catalog.
GPU_EFFICIENCY = 0.7
CATALOG_FILE = "devices.yaml"
# What a CPU training process holds before the model (torch, transformers, the package and a recipe's tokenized
# data; measured by benchmarks/bench_loading.py on the development machine: 0.57 GiB).
CPU_RUNTIME_BYTES = int(0.57 * GIB)
# Catalog keys that are not DeviceSpec fields: ``memory`` (a size such as "80GiB") is ``memory_bytes``, and
# ``gemm_efficiency`` times ``peak_flops`` is ``flops``.
CATALOG_ONLY_KEYS = ("description", "memory", "gemm_efficiency")


@dataclass
class DeviceSpec:
    """What the planner assumes about each rank's device and links; every field can be set by hand.

    Use :meth:`detect` for the current machine.
    """

    device_type: str = "cpu"
    """``"cuda"`` or ``"cpu"``."""
    memory_bytes: int = 8 * GIB
    """Memory one rank may use (its budget)."""
    flops: float = 5e10
    """FLOP/s that large matrix products sustain on one rank (smaller ones are slower, see
    :func:`~mindformers_py.planner.step_time.gemm_seconds`)."""
    intra_node_bandwidth: float = 2e9
    """Bytes/s one rank sends to another of its node (NVLink per direction, PCIe or shared memory)."""
    inter_node_bandwidth: float = 1e9
    """Bytes/s one rank sends to other nodes (its network adapter)."""
    devices_per_node: int = 8
    """Ranks on one node; tensor parallelism stays within a node."""
    headroom: float = 0.1
    """Fraction of ``memory_bytes`` kept free for allocator fragmentation, temporaries and what
    ``runtime_bytes`` leaves out."""
    runtime_bytes: int = 0
    """Memory each process holds besides the model's tensors (the framework and its libraries, the data), counted
    in every estimate: measured for the CPU (:data:`CPU_RUNTIME_BYTES`, what :meth:`detect` sets there); 0 for the
    catalog's GPUs, whose CUDA context the headroom covers until it is measured."""
    maps_frozen_weights: bool = False
    """Whether a frozen weight loaded from a safetensors checkpoint in its own dtype stays a view of the mapped file
    (our CPU loader) instead of a copy in device memory: then an adapter run's input embedding is resident only for
    the rows its steps look up (measured on a 152K-vocabulary slice: 0.56 GiB of its 0.58 GiB table never read).
    :meth:`detect` sets it on CPU; device memory (CUDA) holds every weight whole."""
    micro_batch_overhead_s: float = 1e-3
    """Fixed cost of running one micro-batch through one stage (kernel launches, Python), which makes very small
    micro-batches lose."""
    name: str = ""
    """Catalog name (``a100_80gb``, ``h100_80gb``, ...), or empty for a detected or hand-made spec."""
    peak_flops: float = 0.0
    """Datasheet peak of the matrix units (dense bf16); used for MFU and for fused attention's rate. 0: unknown."""
    hbm_bandwidth: float = 0.0
    """Bytes/s of device memory; times memory-bound kernels and thin matrix products. 0: not modelled."""
    memory_efficiency: float = 1.0
    """Fraction of ``hbm_bandwidth`` that memory-bound kernels reach."""
    attention_efficiency: float = 0.0
    """Fraction of ``peak_flops`` fused attention kernels reach. 0: attention runs at ``flops``."""
    bandwidth_efficiency: float = 1.0
    """Fraction of the link bandwidths that collectives reach (NCCL's bus bandwidth over the link's)."""
    link_latency_s: float = 0.0
    """Latency of one step of a collective."""

    @property
    def usable_bytes(self) -> int:
        """``memory_bytes`` less the headroom: what an estimate must fit in."""
        return int(self.memory_bytes * (1.0 - self.headroom))

    @classmethod
    def detect(cls, device_type: str | None = None, memory_budget: int | float | str | None = None,
               devices_per_node: int | None = None, world_size: int = 1, **overrides: Any) -> DeviceSpec:
        """The spec of this machine.

        Args:
            device_type: ``"cuda"`` or ``"cpu"`` (default: CUDA when visible).
            memory_budget: bytes per rank (an int, or a string such as ``"6GiB"``/``"512MB"``); default: the free
                memory of the current GPU (``torch.cuda.mem_get_info``), or on CPU the host's available memory
                (``MemAvailable`` in ``/proc/meminfo``) shared by the ranks of this node.
            devices_per_node: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``, else the visible GPUs on
                CUDA, else ``world_size``).
            world_size: ranks in the job, used for the CPU share and the per-node default.
            overrides: any other field (``flops``, bandwidths, ``headroom``).
        """
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if devices_per_node is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local:
                devices_per_node = int(local)
            elif device_type == "cuda" and torch.cuda.is_available():
                devices_per_node = max(torch.cuda.device_count(), 1)
            else:
                devices_per_node = max(world_size, 1)
        devices_per_node = min(devices_per_node, max(world_size, 1))
        if device_type == "cuda":
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            known = catalog_name_for(name)
            if known:
                spec = dataclasses.replace(load_device(known), devices_per_node=devices_per_node)
            else:
                peak = next((f for key, f in GPU_PEAK_FLOPS.items() if key in name), 100e12)
                spec = cls(device_type="cuda", flops=peak * GPU_EFFICIENCY, intra_node_bandwidth=100e9,
                           inter_node_bandwidth=20e9, devices_per_node=devices_per_node, micro_batch_overhead_s=2e-4,
                           peak_flops=peak)
            memory = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else spec.memory_bytes
        else:
            spec = cls(device_type="cpu", devices_per_node=devices_per_node, runtime_bytes=CPU_RUNTIME_BYTES,
                       maps_frozen_weights=True)
            available = host_available_memory()
            memory = available // devices_per_node if available else spec.memory_bytes
        if memory_budget is not None:
            memory = parse_bytes(memory_budget)
        return dataclasses.replace(spec, memory_bytes=int(memory), **overrides)


@cache
def device_catalog() -> dict[str, dict[str, Any]]:
    """The accelerators shipped in ``devices.yaml``: name -> catalog entry."""
    text = resources.files(__package__).joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def catalog_name_for(gpu_name: str) -> str | None:
    """The catalog entry for a CUDA device name such as ``"NVIDIA A100-SXM4-80GB"`` (None when unknown)."""
    upper = gpu_name.upper().replace(" ", "")
    if "H200" in upper:
        return "h200"
    if "H100" in upper:
        return "h100_80gb"
    if "A100" in upper:
        return "a100_80gb" if "80G" in upper else "a100_40gb"
    return None


def load_device(name: str, **overrides: Any) -> DeviceSpec:
    """The catalog's spec of accelerator ``name`` with ``overrides`` applied (any :class:`DeviceSpec` field or
    catalog key; strings are converted, e.g. ``memory="96GiB"``, ``inter_node_bandwidth="50e9"``).

    Raises:
        ConfigError: unknown device or field, or a value that is not a number.
    """
    catalog = device_catalog()
    if name not in catalog:
        raise ConfigError(f"device={name!r} is not known; choose one of: {', '.join(catalog)}")
    entry = {**catalog[name], **overrides}
    fields = {f.name: f for f in dataclasses.fields(DeviceSpec)}
    values: dict[str, Any] = {"name": name, "device_type": "cuda"}
    for key, value in entry.items():
        if key == "description":
            continue
        if key in ("memory", "memory_bytes"):
            try:
                values["memory_bytes"] = parse_bytes(value)
            except ConfigError:
                raise ConfigError(f"device field {key}={value!r} is not valid; expected a size such as 80GiB or "
                                  "85899345920") from None
        elif key == "gemm_efficiency" or (key in fields and fields[key].type in ("float", "int")):
            values[key] = _number(key, value, integer=key in fields and fields[key].type == "int")
        elif key in fields:
            values[key] = value
        else:
            valid = sorted({*fields, *CATALOG_ONLY_KEYS} - {"description"})
            raise ConfigError(f"device field {key!r} is not known; choose one of: {', '.join(valid)}")
    gemm = values.pop("gemm_efficiency", None)
    if "flops" not in overrides and gemm is not None:
        values["flops"] = values.get("peak_flops", 0.0) * gemm
    return DeviceSpec(**values)


def _number(key: str, value: Any, integer: bool) -> float | int:
    """``value`` as a positive number (``"50e9"`` and ``50e9`` alike)."""
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        number = -1.0
    if number < 0 or (integer and (number < 1 or number != int(number))):
        kind = "a positive integer" if integer else "a number >= 0"
        raise ConfigError(f"device field {key}={value!r} is not valid; expected {kind}")
    return int(number) if integer else number


def host_available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of memory the host can give new processes (``MemAvailable``), or None when unknown."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """A memory size as bytes: a number, or a string with a unit (``"6GiB"``, ``"512 MB"``, ``"1.5gb"``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if unit in _UNITS and amount > 0:
            return int(amount * _UNITS[unit])
    raise ConfigError(f"memory_budget={value!r} is not valid; expected a positive byte count such as 8589934592, "
                      "'8GiB' or '512MB'")
