"""The files of a saved peft adapter (peft's format), read without importing torch or peft: whether a folder holds
one, and the base model it names."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved peft adapter (``adapter_config.json``)."""
    return Path(folder, ADAPTER_CONFIG_NAME).is_file()


def adapter_base(folder: str | Path) -> str:
    """The base model a saved adapter was trained on (its ``base_model_name_or_path``)."""
    path = Path(folder, ADAPTER_CONFIG_NAME)
    try:
        base = json.loads(path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"adapter config {path} cannot be read ({type(err).__name__})") from None
    if not base:
        raise CheckpointError(f"adapter {folder} names no base model (base_model_name_or_path in {ADAPTER_CONFIG_NAME});"
                              " set it to the folder of the model the adapter was trained on")
    return str(base)
