"""Checkpoints written in the background while training goes on (``TrainingArguments.save_async``).

A save has two parts: taking the state (weights, optimizer and scheduler state, RNG) and writing it. Asynchronously,
the step waits only for the first: :func:`snapshot` copies every tensor to host memory (a copy the next optimizer
step cannot change), and :class:`CheckpointWriter` writes the copy in one background thread. At most one save is in
flight: the next one waits for it first, and :meth:`CheckpointWriter.wait` (called before the run ends, before the
model is saved and before the best checkpoint is loaded) waits for it and raises what it failed with. The folder is
written under a temporary name and renamed when complete, as a synchronous save is, so an interrupted or failed
background write leaves no checkpoint under a final name.

Distributed engines write their shards with collectives; in the background those run on a process group of their
own (gloo), so they never interleave with the training step's collectives on the default group.
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def snapshot(state: Any) -> Any:
    """A copy of ``state`` (nested dicts, lists and tuples of tensors, DTensors and plain values) that later training
    steps cannot change: every tensor copied to host memory, tensors that shared storage (tied weights) still
    sharing one copy, so ``save_pretrained`` sees the ties; other values deep-copied."""
    memo: dict[Any, torch.Tensor] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), tuple(local.stride()),
               local.dtype, type(tensor))
        if key not in memo:
            memo[key] = tensor.detach().to("cpu", copy=True)
        return memo[key]

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return copy_tensor(value)
        if isinstance(value, dict):
            copied = {k: walk(v) for k, v in value.items()}
            return copied if type(value) is dict else type(value)(copied)  # an OrderedDict stays one
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v) for v in value)
        return copy.deepcopy(value)

    # A memory-bound copy: one thread, rather than an OpenMP pool that spins (ten times slower here) when the cores are
    # shared with other work. Nothing else runs torch operations meanwhile: the previous background write is done.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return walk(state)
    finally:
        torch.set_num_threads(threads)


class CheckpointWriter:
    """One background thread that writes checkpoints, one at a time.

    :meth:`submit` waits for the save in flight (raising its error), then starts ``job`` in the thread;
    :meth:`raise_if_failed` reports a finished save's error without waiting; :meth:`wait` waits for the save in
    flight. Errors surface in the training thread, at the next of these calls.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._what = ""

    @property
    def in_flight(self) -> bool:
        """Whether a save was submitted and not yet waited for."""
        return self._future is not None

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Run ``job`` (writing the checkpoint ``what``) in the background once the previous save is done."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._future, self._what = self._executor.submit(job), what

    def raise_if_failed(self) -> None:
        """Raise the error of a finished background save (and forget it); never waits."""
        if self._future is not None and self._future.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise what it failed with."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
