"""Keeping freed CPU memory in the process heap, so training steps stop page-faulting their large tensors in."""

from __future__ import annotations

import ctypes
import sys

# glibc mallopt parameters and the values keep_freed_cpu_memory sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 1 << 30
_TRIM_THRESHOLD_BYTES = (1 << 31) - 1


def keep_freed_cpu_memory() -> bool:
    """Make glibc keep freed memory in the process heap for reuse (``mallopt``); returns whether it applied.

    By default glibc serves every allocation above 32 MiB with a fresh ``mmap`` and unmaps it when freed, so a
    CPU training step page-faults its large activations, logits and gradients in again every time (for GPT-2
    small-vocab runs, hundreds of thousands of faults and about a quarter of the step). Serving allocations up
    to 1 GiB from the heap and never trimming it makes later steps reuse the same pages. Resident memory then
    stays at its peak instead of shrinking between steps. A no-op where the C library is not glibc.

    The setting is process-wide, so a benchmark comparing two training loops must give both the same setting.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


def return_freed_cpu_memory() -> bool:
    """Give the memory freed so far back to the OS (glibc ``malloc_trim``), however :func:`keep_freed_cpu_memory`
    set the heap: for the moment a process has dropped something large it will not allocate again in the same
    sizes (a trained model's shards, before the model is loaded again for generation). Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
