"""``convert_checkpoint``: our checkpoints <-> HF checkpoints of the same architecture, weights and tokenizer."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .adapters.files import adapter_base, is_adapter_folder
from .auto import EXTRA_AUTO_CLASSES, _read_config_json, auto_class_for, load_model_class, resolve_config
from .errors import CheckpointError, check_choice
from .models.registry import BASE, Family
from .task_registry import task_for_architectures
from .checkpoint.safetensors_io import INDEX_NAME, WEIGHTS_NAME, atomic_folder, save_state_dict

DIRECTIONS = ("hf", "mindformers")
# Everything else in a checkpoint folder (tokenizer files, README, ...) is copied along unchanged.
_REWRITTEN = {"config.json", "generation_config.json", WEIGHTS_NAME, INDEX_NAME}


def checkpoint_task(architectures: list[str] | None, family: Family) -> str:
    """The task (or ``"base"``, or the key of one of the family's ``extra_model_classes``) of a checkpoint from its
    ``architectures``; a config without them (written by hand) is taken as the family's language model when it has
    one."""
    extra = _extra_class_key(architectures[0], family) if architectures else None
    if extra is not None:
        return extra
    spec = task_for_architectures(architectures)
    if spec is not None:
        return spec.name
    if not architectures:
        return next((t for t in ("causal_lm", "masked_lm", "seq2seq_lm") if t in family.model_classes), BASE)
    return BASE


def _extra_class_key(architecture: str, family: Family) -> str | None:
    """The key of the family's extra model class an HF or our architecture name is (``BertForPreTraining``,
    ``GPT2DoubleHeadsModel``, ``MT5EncoderModel``, ...): the same name after the family's prefix."""
    for key, cls in family.extra_model_classes.items():
        prefix = family.config_class.__name__.removesuffix("Config")
        kind = cls.__name__.removeprefix(prefix)  # "ForPreTraining", "DoubleHeadsModel", "EncoderModel"
        if architecture == cls.__name__ or architecture.endswith(kind) and architecture[:-len(kind)].isalnum():
            return key
    return None


def _load(task: str, src: Path, family: Family):
    """The model of the checkpoint at ``src`` as the class serving ``task``."""
    if task in family.extra_model_classes and task not in EXTRA_AUTO_CLASSES:
        return load_model_class(family.extra_model_classes[task], src)
    return auto_class_for(task).from_pretrained(src)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "hf", merge: bool = False) -> Path:
    """Convert the checkpoint folder ``src`` into ``dst``.

    ``to="hf"`` writes what transformers loads as the matching HF class (``GPT2LMHeadModel``,
    ``LlamaForCausalLM``, ...); ``to="mindformers"`` writes our format (from an HF or our own checkpoint).
    A peft adapter folder (``adapter_config.json``) is written under transformers' module names (``to="hf"``), for
    ``PeftModel.from_pretrained`` on transformers' model; with ``merge`` it is merged into its base model (peft's
    ``merge_and_unload``) and the whole model is written instead.
    The destination is written under a temporary name and appears only when complete.
    """
    check_choice("to", to, DIRECTIONS)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"source checkpoint {src} does not exist or is not a folder")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {dst} is the source folder; choose another destination")
    if is_adapter_folder(src):
        return _convert_adapter(src, dst, to, merge)
    family = resolve_config(src)[1]
    task = checkpoint_task(_read_config_json(src).get("architectures"), family)
    model = _load(task, src, family)
    with atomic_folder(dst) as tmp:
        if to == "mindformers":
            model.save_pretrained(tmp)
        else:
            conv = family.converter
            hf_type = conv.hf_type_for(model.config)
            hf_config = conv.config_to_hf(model.config)
            hf_class = family.hf_model_classes.get(task, lambda _: None)(hf_type)
            if hf_class is None:
                raise CheckpointError(f"a {task} model of HF architecture {hf_type!r} has no transformers class to "
                                      "export to; convert the base model or another head")
            hf_config.architectures = [hf_class]
            state = model.state_dict()
            if task == BASE:
                state = {f"{model.base_model_prefix}.{k}": v for k, v in state.items()}
            hf_state = conv.state_dict_to_hf(state, model.config, task)
            if task == BASE:  # HF base models have no "model."/"transformer." prefix
                hf_state = {k.split(".", 1)[1] if k.startswith(("model.", "transformer.")) else k: v for k, v in hf_state.items()}
            hf_config.save_pretrained(tmp)
            save_state_dict(hf_state, tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
        for item in src.iterdir():
            if item.name not in _REWRITTEN and not item.name.endswith(".safetensors") and item.is_file():
                shutil.copy2(item, tmp / item.name)
    return dst


def _convert_adapter(src: Path, dst: Path, to: str, merge: bool) -> Path:
    """A saved peft adapter under transformers' names, or (``merge``) its base model with it merged in."""
    from .adapters.export import adapter_task, export_adapter, merged_model

    base = adapter_base(src)
    task = adapter_task(src) or checkpoint_task(_read_config_json(Path(base)).get("architectures"),
                                                resolve_config(base)[1])
    if not merge:
        if to != "hf":
            raise CheckpointError(f"{src} is an adapter in our format already; convert it with to='hf', or merge=True "
                                  "to write its base model with the adapter merged in")
        return export_adapter(src, dst, task, base)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".merged-", dir=dst.parent) as tmp:
        merged_model(src, task, base).save_pretrained(tmp)
        for item in src.iterdir():  # the tokenizer saved with the adapter
            if item.is_file() and not item.name.startswith("adapter_") and item.name != "README.md":
                shutil.copy2(item, Path(tmp) / item.name)
        return convert_checkpoint(tmp, dst, to=to)
