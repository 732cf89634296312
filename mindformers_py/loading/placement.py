"""Where a loaded model's weights go: transformers' ``device_map`` (a device, a per-module dict, or a strategy
planned with accelerate, ``"disk"`` offloading included) and the modules kept in float32 under a lower dtype. The
model arrives built on ``meta`` (:mod:`mindformers_py.loading.deferred`); this gives it its weights."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from .deferred import materialize

if TYPE_CHECKING:  # transformers' modeling module costs seconds; it loads with the first model
    from transformers import PreTrainedModel

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The ``device_map`` strings accelerate plans (a device name or index places the whole model)."""


def kept_in_fp32(model: PreTrainedModel, dtype: torch.dtype | None) -> tuple[str, ...]:
    """The module names whose parameters stay float32 in ``dtype``, by transformers' rules:
    ``_keep_in_fp32_modules_strict`` under float16 and bfloat16, ``_keep_in_fp32_modules`` under float16."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return tuple(sorted(keep))


def place(model: PreTrainedModel, device_map: Any, max_memory: dict | None = None,
           offload_folder: str | os.PathLike | None = None) -> PreTrainedModel:
    """Give the ``meta``-built model its weights where transformers' ``device_map`` says: a device, ``{"": device}``,
    a per-module dict, or a strategy such as ``"auto"`` (planned with accelerate on the empty model within
    ``max_memory`` per device, then each weight is loaded straight onto its device and accelerate's hooks move
    activations between devices). Modules the map sends to ``"disk"`` are written to ``offload_folder`` and read
    back by accelerate's hooks when they run, as in transformers."""
    from transformers.modeling_utils import get_torch_context_manager_or_global_device

    planned = isinstance(device_map, dict) or (isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES)
    if (max_memory is not None or offload_folder is not None) and not planned:
        name = "max_memory" if max_memory is not None else "offload_folder"
        raise ConfigError(f"{name} plans where modules go and needs device_map='auto' (or a dict of module -> "
                          f"device); got device_map={device_map!r}")
    if device_map is None:  # as transformers: the device of a `with torch.device(...)` block or the default device
        device = get_torch_context_manager_or_global_device() or torch.device("cpu")
        if device.type == "meta":
            raise ConfigError("from_pretrained reads weights, which a meta device (torch.set_default_device('meta') or "
                              "a `with torch.device('meta')` block) cannot hold; build an empty model with from_config "
                              "there, or load outside it")
        return materialize(model, device)
    if isinstance(device_map, (int, torch.device)) or (isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES):
        return materialize(model, torch.device(device_map))
    from accelerate import dispatch_model, infer_auto_device_map

    if isinstance(device_map, str):
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=list(model._no_split_modules or []))
    if not isinstance(device_map, dict):
        raise ConfigError(f"device_map={device_map!r} is not valid; expected a device, a dict of module -> device, or "
                          f"one of: {', '.join(DEVICE_MAP_STRATEGIES)}")
    device_map = dict(device_map)
    where = lambda d: torch.device("cpu") if d == "disk" else torch.device(d)
    devices = set(device_map.values())
    if len(devices) == 1:  # one device: a plain placement, no dispatch hooks
        model = materialize(model, where(next(iter(devices))))
    else:
        def device_of(name: str) -> torch.device:
            parts = name.split(".")
            for i in range(len(parts), -1, -1):
                if ".".join(parts[:i]) in device_map:
                    return where(device_map[".".join(parts[:i])])
            return torch.device("cpu")

        if "disk" in devices and offload_folder is None:
            raise ConfigError("device_map puts modules on 'disk' (they do not fit max_memory); pass offload_folder "
                              "(a folder for their weights) or more max_memory")
        model = dispatch_model(materialize(model, device_of), device_map, offload_dir=offload_folder)
    model.hf_device_map = device_map
    return model
