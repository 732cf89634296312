"""Whether a run compiles its layers when it is not told: ``TrainingArguments.torch_compile="auto"`` (the default).

Decided by measurement, as ``bf16="auto"`` is (:mod:`.precision`):

* CUDA: compiling each transformer layer (inductor fuses the memory-bound work between the matrix products) made the
  Llama-3.2-1B-shaped bf16 step (batch 4 x 2048, one H100 80GB, torch 2.11) 1.39x transformers' Trainer with 12% less
  peak memory (38.6 against 43.8 GiB), where the eager step was 1.06x with 9% more. The compilation is paid once, in
  the first step (``train_first_step_runtime``), and kept in inductor's on-disk cache for later runs of the shapes.
* CPU: slower than the eager step (GPT benchmark on 2 cores: 1.21x of transformers compiled against 1.56x eager in
  the same run, and 14.7 s to the first step instead of 0.4 s), so ``"auto"`` means off there and nothing changes
  for a CPU run.

``"auto"`` also means off where compiled layers are refused or may be: context parallelism (its attention exchanges
keys and values inside each layer), and ``auto_parallel``, whose planner may choose context parallelism for long
sequences. ``torch_compile=True`` still asks for it anywhere it is supported.
"""

from __future__ import annotations

from typing import Any

from .precision import training_device

AUTO = "auto"
"""The ``torch_compile`` setting that lets the device (and the layout) decide."""


def resolve_torch_compile(torch_compile: bool | str, use_cpu: bool, parallel_config: Any = None) -> bool:
    """The ``torch_compile`` flag a run uses: ``torch_compile`` itself when it is a bool; for ``"auto"``, True when
    the training device is a CUDA GPU and the layout (a ``ParallelConfig``, or None for one process) neither runs
    context parallelism nor is left to the ``auto_parallel`` planner."""
    if torch_compile != AUTO:
        return bool(torch_compile)
    return auto_decision(use_cpu, parallel_config)[0]


def auto_reason(use_cpu: bool, parallel_config: Any = None) -> str:
    """Why ``"auto"`` decided as :func:`resolve_torch_compile` did, in words for the run's log."""
    return auto_decision(use_cpu, parallel_config)[1]


def auto_decision(use_cpu: bool, parallel_config: Any = None) -> tuple[bool, str]:
    """What ``"auto"`` decides, and why (one place for both, so the log cannot say other than what was done)."""
    device = training_device(use_cpu).type
    if device != "cuda":
        return False, f"training on {device}, where compiled layers are slower than eager ones"
    if parallel_config is not None and parallel_config.parallel_mode == "auto_parallel":
        return False, "the auto_parallel planner may choose context parallelism, which compiled layers do not support"
    if parallel_config is not None and parallel_config.cp > 1:
        return False, ("context parallelism exchanges keys and values inside each layer, which compiled layers do not "
                       "support")
    return True, "training on CUDA, where compiled layers are faster and leaner than eager ones"
