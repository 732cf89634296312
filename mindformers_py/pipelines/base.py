"""The task table behind :func:`mindformers_py.pipeline` and the loading of a pipeline's model and preprocessor.

A task is one :class:`PipelineTask` entry in :data:`PIPELINES`: its transformers-style name, MindFormers-style aliases,
the pipeline class (a transformers ``Pipeline`` subclass, so pre- and post-processing are transformers' own), the
training task it serves in the task registry (whose Auto class loads the model from a preset or a checkpoint
folder), and the preprocessor it needs.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, Pipeline, PreTrainedModel

from ..adapters.apply import from_pretrained_with_adapter, is_peft_model
from ..models.hub import HUB_KWARGS, resolve_source
from ..adapters.files import is_adapter_folder
from ..auto import auto_class_for
from ..errors import MindFormersError, invalid_choice
from ..models import registry
from ..utils.damaged_files import loading_from

logger = logging.getLogger(__name__)

class AcceptsOurModels:
    """Mixin for a transformers ``Pipeline`` subclass: our families' models count as supported (transformers
    checks the class name against its own tables, which list only transformers' classes, and logs an error); and
    ``close()`` / ``with`` stop the worker pool of a parallel pipeline."""

    def check_model_type(self, supported_models: list[str] | dict) -> None:
        """transformers' check, passing our families' model classes."""
        ours = {cls for family in registry.FAMILIES for cls in family.model_classes.values()}
        if type(self.model) in ours or any(isinstance(self.model, cls) for cls in ours):
            return
        super().check_model_type(supported_models)

    def close(self) -> None:
        """Stop the worker processes of a parallel pipeline (``parallel_config``); nothing for one process."""
        close_pool = getattr(self.model, "close_pool", None)
        if close_pool is not None:
            close_pool()

    def __enter__(self) -> AcceptsOurModels:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


PREPROCESSOR_LOADERS: dict[str, Any] = {"tokenizer": AutoTokenizer, "image_processor": AutoImageProcessor}
"""Preprocessor argument of a pipeline -> the transformers Auto class that loads it from a folder."""


@dataclass(frozen=True)
class PipelineTask:
    """One task of :func:`mindformers_py.pipeline`."""

    name: str
    """Task name as transformers spells it (``"text-generation"``)."""
    pipeline_class: type[Pipeline]
    """The transformers ``Pipeline`` (sub)class that runs the task."""
    task: str
    """The task registry name of the models it runs (``"causal_lm"``; ``"base"`` for bare models); its Auto class
    loads them."""
    aliases: tuple[str, ...] = ()
    """Other accepted names (MindFormers' ``"text_generation"``)."""
    preprocessor: str = "tokenizer"
    """Which preprocessor the pipeline takes: a key of :data:`PREPROCESSOR_LOADERS`."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments given to the pipeline class unless the caller passes them."""

    @property
    def auto_model(self) -> type:
        """The ``mindformers_py`` Auto class loading the task's model from a preset or a checkpoint folder."""
        return auto_class_for(self.task)


PIPELINES: dict[str, PipelineTask] = {}
"""Task name or alias -> its entry."""


def register_pipeline(task: PipelineTask) -> None:
    """Make ``task`` available to :func:`mindformers_py.pipeline` under its name and aliases."""
    for name in (task.name, *task.aliases):
        PIPELINES[name] = task


TRANSLATION_PAIR = re.compile(r"translation_[^_]+_to_[^_]+")
"""transformers' parametrized translation task names (``translation_en_to_de``): the ``translation`` entry."""


def get_pipeline(name: str, field: str = "task") -> PipelineTask:
    """The entry for a task name or alias; an unknown one raises a :class:`ConfigError` naming ``field`` and listing
    every task name, each followed by its aliases."""
    if TRANSLATION_PAIR.fullmatch(name) and "translation" in PIPELINES:
        return PIPELINES["translation"]
    if name not in PIPELINES:
        names = [n for key, entry in PIPELINES.items() if key == entry.name for n in (entry.name, *entry.aliases)]
        raise invalid_choice(field, name, names)
    return PIPELINES[name]


def task_name(name: str, entry: PipelineTask) -> str:
    """The task name a pipeline object gets: the entry's, or the parametrized name given (``translation_en_to_de``,
    whose language pair and ``task_specific_params`` entry the pipeline reads)."""
    return name if TRANSLATION_PAIR.fullmatch(name) else entry.name


def load_model(task: PipelineTask, model: Any, **load_kwargs: Any) -> tuple[PreTrainedModel, Path | None]:
    """The task's model from a model object (a peft model too), a checkpoint folder (ours or HF, or a saved peft
    adapter: its base model with the adapter) or a preset name, and the folder it came from (None for objects and
    presets)."""
    if isinstance(model, PreTrainedModel) or is_peft_model(model):
        return model, None
    if isinstance(model, (str, os.PathLike)):
        # where the files are: the folder itself, a packaged checkpoint's, a hub repository's cached snapshot
        hub = {key: load_kwargs[key] for key in HUB_KWARGS if load_kwargs.get(key) not in (None, False, "")}
        folder = Path(resolve_source(model, **{k: v for k, v in hub.items() if k != "subfolder"}), hub.get("subfolder", ""))
        if is_adapter_folder(model):  # a saved peft adapter: its base model, then the adapter on it
            return from_pretrained_with_adapter(task.auto_model, model, **load_kwargs), folder
        loaded, info = task.auto_model.from_pretrained(model, output_loading_info=True, **load_kwargs)
        if info["missing_keys"] and task.task != "base":
            # e.g. fill-mask on all-MiniLM-L6-v2, a checkpoint of embeddings without its masked-LM head
            logger.warning("pipeline(%r) on %s: the checkpoint has no trained head for this task (%d tensors newly "
                           "initialised, e.g. %s), so the outputs are noise; fine-tune it first, or use "
                           "pipeline('feature-extraction') for the checkpoint's embeddings", task.name, model,
                           len(info["missing_keys"]), sorted(info["missing_keys"])[0])
        return loaded, folder if folder.is_dir() else None
    if model is None:
        what = "a model object, a checkpoint folder or a preset (" + ", ".join(registry.all_presets()) + ")"
        raise MindFormersError(f"pipeline({task.name!r}) needs model=...: {what}")
    raise MindFormersError(f"model={type(model).__name__} is not a model, a checkpoint folder or a preset name")


def load_preprocessor(task: PipelineTask, given: Any, folder: Path | None, model: PreTrainedModel,
                      **load_kwargs: Any) -> Any:
    """The preprocessor given (an object or a folder), else the one saved with the model's checkpoint;
    ``load_kwargs`` (``use_fast``, ``revision``, ...) go to its ``from_pretrained``."""
    loader = PREPROCESSOR_LOADERS[task.preprocessor]
    if given is not None and not isinstance(given, (str, os.PathLike)):
        return given
    source = given if given is not None else folder
    if source is None and getattr(model, "name_or_path", "") and Path(model.name_or_path).is_dir():
        source = model.name_or_path  # a model object loaded by transformers from a folder
    if source is None:
        raise MindFormersError(
            f"pipeline({task.name!r}) needs {task.preprocessor}=... when the model is a preset name or a model object "
            "without a checkpoint folder"
        )
    with loading_from(source, task.preprocessor, f"save one there or pass {task.preprocessor}=..."):
        return loader.from_pretrained(os.fspath(source), **load_kwargs)
