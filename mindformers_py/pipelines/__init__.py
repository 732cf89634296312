"""Task pipelines: ``mindformers_py.pipeline(task, model=..., tokenizer=...)``, transformers' pipelines on our models.

Tasks live in :data:`~mindformers_py.pipelines.base.PIPELINES`; adding one is one :func:`register_pipeline` entry below.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import Pipeline, PreTrainedModel

from ..errors import MindFormersError
from .base import PIPELINES, PipelineTask, get_pipeline, load_model, load_preprocessor, register_pipeline, task_name
from .classification import TextClassificationPipeline, TokenClassificationPipeline
from .image_classification import ImageClassificationPipeline
from .encoder import FeatureExtractionPipeline, FillMaskPipeline
from .question_answering import QuestionAnsweringPipeline
from .text2text import SummarizationPipeline, Text2TextGenerationPipeline, TranslationPipeline
from .text_generation import TextGenerationPipeline

register_pipeline(PipelineTask("text-generation", TextGenerationPipeline, "causal_lm", aliases=("text_generation",)))
register_pipeline(PipelineTask("text-classification", TextClassificationPipeline, "sequence_classification",
                           aliases=("text_classification", "sentiment-analysis")))
register_pipeline(PipelineTask("token-classification", TokenClassificationPipeline, "token_classification",
                           aliases=("token_classification", "ner")))
register_pipeline(PipelineTask("image-classification", ImageClassificationPipeline, "image_classification",
                               aliases=("image_classification",), preprocessor="image_processor"))
register_pipeline(PipelineTask("fill-mask", FillMaskPipeline, "masked_lm", aliases=("fill_mask",)))
register_pipeline(PipelineTask("feature-extraction", FeatureExtractionPipeline, "base", aliases=("feature_extraction",)))
register_pipeline(PipelineTask("question-answering", QuestionAnsweringPipeline, "question_answering",
                               aliases=("question_answering", "qa")))
register_pipeline(PipelineTask("text2text-generation", Text2TextGenerationPipeline, "seq2seq_lm",
                               aliases=("text2text_generation",)))
register_pipeline(PipelineTask("summarization", SummarizationPipeline, "seq2seq_lm"))
# "translation_xx_to_yy" names reach this entry too (see get_pipeline); the pipeline reads the pair from the name.
register_pipeline(PipelineTask("translation", TranslationPipeline, "seq2seq_lm"))


def pipeline(
    task: str,
    model: PreTrainedModel | str | os.PathLike | None = None,
    tokenizer: Any = None,
    **kwargs: Any,
) -> Pipeline:
    """A ready pipeline for ``task`` (``"text-generation"``, or MindFormers' ``"text_generation"``, ...).

    Args:
        task: a task name or alias; an unknown one raises an error listing the valid tasks.
        model: a model object, a checkpoint folder (ours, or an HF checkpoint of a supported architecture, converted
            on load) or a preset name (random weights).
        tokenizer: a tokenizer object or folder; None loads the one saved in the model's checkpoint folder (a preset
            name needs one given).
        **kwargs: passed to the pipeline class as with ``transformers.pipeline`` (``device``, ``batch_size``,
            generation parameters such as ``max_new_tokens``, ...). transformers' loading arguments load the model
            and preprocessor here, as in ``transformers.pipeline``: ``model_kwargs`` (a dict of ``from_pretrained``
            keywords), ``dtype``/``torch_dtype``, ``device_map``, ``revision``, ``token``, ``trust_remote_code``
            (the last three also for the tokenizer) and ``use_fast`` (the tokenizer's). ``parallel_config`` (a :class:`~mindformers_py.ParallelConfig` with ``model_parallel``,
            ``pipeline_stage`` and, for MoE models, ``expert_parallel``) makes a generating pipeline run in a pool of
            worker processes holding the model sharded (:mod:`.parallel_pool`); the pool stays up until ``close()``,
            the end of a ``with`` block, or interpreter exit.
    """
    entry = get_pipeline(task)
    load_kwargs, preprocessor_kwargs = _loading_arguments(kwargs)
    parallel_config = kwargs.pop("parallel_config", None)
    pooled = None
    if parallel_config is not None:
        placed = next((key for key in ("device", "device_map") if kwargs.get(key) or load_kwargs.get(key)), None)
        if placed is not None:
            raise MindFormersError(f"{placed}= does not apply with parallel_config: each worker process uses its own "
                                   "device (GPU LOCAL_RANK, else the CPU)")
        from .parallel_pool import start_pooled_model  # the launcher's imports only for parallel pipelines

        pooled = start_pooled_model(entry.pipeline_class, entry.name, entry.auto_model, entry.task, model,
                                    parallel_config, load_kwargs)
    if pooled is not None:
        model, folder = pooled
        kwargs["device"] = "cpu"  # inputs and outputs stay here; the workers place them on their devices
    else:
        model, folder = load_model(entry, model, **load_kwargs)
    given = tokenizer if entry.preprocessor == "tokenizer" else kwargs.pop(entry.preprocessor, None)
    preprocessor = load_preprocessor(entry, given, folder, model, **preprocessor_kwargs)
    arguments = {**entry.defaults, **kwargs, entry.preprocessor: preprocessor}
    return entry.pipeline_class(model=model, task=task_name(task, entry), **arguments)


_MODEL_LOADING = ("dtype", "torch_dtype", "device_map")
_HUB_LOADING = ("revision", "token", "trust_remote_code")


def _loading_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Take transformers' loading arguments of ``pipeline()`` out of ``kwargs`` (so they never reach the pipeline
    class, whose ``generate`` would refuse them): ``(from_pretrained keywords, preprocessor keywords)``."""
    load_kwargs = dict(kwargs.pop("model_kwargs", None) or {})
    for key in _MODEL_LOADING + _HUB_LOADING:
        value = kwargs.pop(key, None)
        if value is None:
            continue
        if key in load_kwargs:  # transformers refuses the same argument given twice
            raise MindFormersError(f"pipeline got {key}= both directly and in model_kwargs; give it once")
        load_kwargs[key] = value
    preprocessor_kwargs = {key: load_kwargs[key] for key in _HUB_LOADING if key in load_kwargs}
    if kwargs.get("use_fast") is not None:
        preprocessor_kwargs["use_fast"] = kwargs.pop("use_fast")
    kwargs.pop("use_fast", None)
    return load_kwargs, preprocessor_kwargs


__all__ = ["pipeline", "PipelineTask", "register_pipeline", "get_pipeline", "PIPELINES", "TextClassificationPipeline",
           "TextGenerationPipeline", "TokenClassificationPipeline", "ImageClassificationPipeline", "FillMaskPipeline",
           "FeatureExtractionPipeline", "QuestionAnsweringPipeline", "Text2TextGenerationPipeline",
           "SummarizationPipeline", "TranslationPipeline"]
