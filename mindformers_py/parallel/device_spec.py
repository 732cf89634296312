"""What the ``auto_parallel`` planner assumes about each rank's device: memory budget, sustained FLOP/s and link
bandwidths (:class:`DeviceSpec`, detected from the current machine or set by hand), and :func:`parse_bytes` for
memory sizes given as text.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

GIB = 1024**3
# Peak dense bf16 tensor-core FLOP/s of common GPUs, matched against the device name (fp32 runs use half).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40": 181e12, "A10": 125e12, "V100": 125e12,
                  "T4": 65e12}
# Peak FLOP/s reached in training (model FLOPs utilisation).
GPU_EFFICIENCY = 0.4


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
    """Sustained FLOP/s of one rank in training."""
    intra_node_bandwidth: float = 2e9
    """Bytes/s of a collective between ranks of one node (NVLink, PCIe or shared memory)."""
    inter_node_bandwidth: float = 1e9
    """Bytes/s of a collective between nodes."""
    devices_per_node: int = 8
    """Ranks on one node; tensor parallelism stays within a node."""
    headroom: float = 0.1
    """Fraction of ``memory_bytes`` kept free for allocator fragmentation, temporaries and the runtime."""
    micro_batch_overhead_s: float = 1e-3
    """Fixed cost of running one micro-batch through one stage (kernel launches, Python), which makes very small
    micro-batches lose."""

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
            peak = next((f for key, f in GPU_PEAK_FLOPS.items() if key in name), 100e12)
            spec = cls(device_type="cuda", flops=peak * GPU_EFFICIENCY, intra_node_bandwidth=100e9,
                       inter_node_bandwidth=20e9, devices_per_node=devices_per_node, micro_batch_overhead_s=2e-4)
            memory = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else spec.memory_bytes
        else:
            spec = cls(device_type="cpu", devices_per_node=devices_per_node)
            available = host_available_memory()
            memory = available // devices_per_node if available else spec.memory_bytes
        if memory_budget is not None:
            memory = parse_bytes(memory_budget)
        return dataclasses.replace(spec, memory_bytes=int(memory), **overrides)


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
