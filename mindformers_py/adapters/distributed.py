"""Saving and loading a peft adapter trained under any layout: only the adapter's tensors are gathered (the frozen
base model stays where it is), and rank 0 writes them in peft's format (``adapter_config.json``,
``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .apply import adapter_state, read_adapter_state, write_adapter

_TRAINABLE_ONLY = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)


def gathered_adapter(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole adapter of a parallelized peft model under its saved names, on the CPU, on rank 0 (None
    elsewhere); collective. Each rank names its own tensors (pipeline ranks hold different stages)."""
    own = {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=_TRAINABLE_ONLY).items()}
    tensors = adapter_state(model, own)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(tensors, parts, dst=0)
    if parts is None:
        return None
    return {key: value for part in parts for key, value in part.items()}


def save_adapter(model: nn.Module, folder: str | Path, processing_class: Any = None) -> None:
    """Write the adapter of a parallelized peft model into ``folder`` in peft's format (rank 0), and the
    tokenizer/processor beside it; collective."""
    tensors = gathered_adapter(model)
    if tensors is None:
        return
    write_adapter(model, folder, tensors)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(folder)


def load_adapter(model: nn.Module, folder: str | Path) -> None:
    """Load adapter weights saved by peft (any layout, or one process) into a parallelized peft model; every rank
    reads the file and keeps its own shards (a pipeline rank its own stages' tensors)."""
    state = read_adapter_state(model, folder)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
