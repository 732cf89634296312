"""``convert_checkpoint``: our checkpoints <-> HF checkpoints of the same architecture, weights and tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .auto import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, _read_config_json, resolve_config
from .errors import CheckpointError, check_choice
from .utils.safetensors_io import INDEX_NAME, WEIGHTS_NAME, atomic_folder, save_state_dict

DIRECTIONS = ("hf", "mindformers")
_AUTO_BY_TASK = {"base": AutoModel, "causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification}
# Everything else in a checkpoint folder (tokenizer files, README, ...) is copied along unchanged.
_REWRITTEN = {"config.json", "generation_config.json", WEIGHTS_NAME, INDEX_NAME}


def _task_of(architectures: list[str] | None) -> str:
    name = (architectures or [""])[0]
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    if name.endswith(("LMHeadModel", "ForCausalLM")):
        return "causal_lm"
    return "base" if name else "causal_lm"


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "hf") -> Path:
    """Convert the checkpoint folder ``src`` into ``dst``.

    ``to="hf"`` writes what transformers loads as the matching HF class (``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ...); ``to="mindformers"`` writes our format (from an HF or our own checkpoint).
    The destination is written under a temporary name and appears only when complete.
    """
    check_choice("to", to, DIRECTIONS)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"source checkpoint {src} does not exist or is not a folder")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {dst} is the source folder; choose another destination")
    task = _task_of(_read_config_json(src).get("architectures"))
    model = _AUTO_BY_TASK[task].from_pretrained(src)
    family = resolve_config(src)[1]
    with atomic_folder(dst) as tmp:
        if to == "mindformers":
            model.save_pretrained(tmp)
        else:
            conv = family.converter
            hf_type = conv.hf_type_for(model.config)
            hf_config = conv.config_to_hf(model.config)
            hf_config.architectures = [family.hf_model_classes[task](hf_type)]
            state = model.state_dict()
            if task == "base":
                state = {f"model.{k}": v for k, v in state.items()}
            hf_state = conv.state_dict_to_hf(state, model.config)
            if task == "base":  # HF base models have no "model."/"transformer." prefix
                hf_state = {k.split(".", 1)[1] if k.startswith(("model.", "transformer.")) else k: v for k, v in hf_state.items()}
            hf_config.save_pretrained(tmp)
            save_state_dict(hf_state, tmp)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(tmp)
        for item in src.iterdir():
            if item.name not in _REWRITTEN and not item.name.endswith(".safetensors") and item.is_file():
                shutil.copy2(item, tmp / item.name)
    return dst
