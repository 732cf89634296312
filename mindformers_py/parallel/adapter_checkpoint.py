"""Saving and loading a peft adapter trained under any layout: only the adapter's tensors are gathered (the frozen
base model stays where it is), and rank 0 writes them with peft's own ``save_pretrained`` (``adapter_config.json``,
``adapter_model.safetensors``), the format ``PeftModel.from_pretrained`` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..adapters.apply import read_adapter_state

_TRAINABLE_ONLY = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)


def gathered_adapter_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Every trainable tensor of a parallelized peft model, whole and on the CPU, on rank 0 (None elsewhere);
    collective. Pipeline ranks each contribute their stages' tensors."""
    state = {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=_TRAINABLE_ONLY).items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return state
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def save_adapter(model: nn.Module, folder: str | Path, processing_class: Any = None) -> None:
    """Write the adapter of a parallelized peft model into ``folder`` in peft's format (rank 0), and the
    tokenizer/processor beside it; collective."""
    state = gathered_adapter_state(model)
    if state is None:
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), state_dict=state)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(folder)


def load_adapter(model: nn.Module, folder: str | Path) -> None:
    """Load adapter weights saved by peft (any layout, or one process) into a parallelized peft model; every rank
    reads the file and keeps its own shards (a pipeline rank its own stages' tensors)."""
    state = read_adapter_state(model, folder)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
