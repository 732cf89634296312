"""What an engine reads from the training arguments.

Engines sit below the Trainer (cli -> recipes -> trainer -> engine -> parallel), so they do not import
``TrainingArguments``; any object with these attributes drives them (the Trainer passes its ``TrainingArguments``).
"""

from __future__ import annotations

from typing import Protocol


class EngineArguments(Protocol):
    """The training-argument fields an engine uses (names and meanings as in ``TrainingArguments``)."""

    per_device_train_batch_size: int
    """Samples per data-parallel rank per micro-batch (checked against the pipeline micro-batches)."""
    learning_rate: float
    """AdamW learning rate."""
    weight_decay: float
    """AdamW weight decay (matrices and embeddings only)."""
    adam_beta1: float
    """AdamW beta1."""
    adam_beta2: float
    """AdamW beta2."""
    adam_epsilon: float
    """AdamW epsilon."""
    optim: str
    """``"adamw_torch_fused"`` or ``"adamw_torch"``."""
    bf16: bool
    """bfloat16 mixed precision."""
    fp16: bool
    """float16 mixed precision with loss scaling (CUDA only)."""
    use_cpu: bool
    """Train on the CPU even when a GPU is visible."""
    cpu_keep_freed_memory: bool
    """Keep freed CPU memory in the heap (see :func:`~.cpu_memory.keep_freed_cpu_memory`)."""
    torch_compile: bool
    """``torch.compile`` the model (each transformer layer under the distributed engines)."""
    torch_compile_backend: str | None
    """``torch.compile`` backend (None: inductor)."""
    torch_compile_mode: str | None
    """``torch.compile`` mode."""
    ddp_timeout: int
    """Seconds without progress (or in one collective) after which a distributed job ends, naming the rank it waits
    for (:mod:`~mindformers_py.launcher.watchdog`)."""
    save_async: bool
    """Write checkpoints in a background thread (:mod:`~mindformers_py.checkpoint.background_writer`)."""
