"""Text-to-text pipelines for encoder-decoder models: ``text2text-generation``, ``summarization`` and
``translation`` (``translation_xx_to_yy``), which transformers 5 removed.

They behave as transformers 4.x's did (the tests compare with outputs recorded from transformers 4.57 on a
committed checkpoint):

* outputs are lists of ``{"generated_text"}`` / ``{"summary_text"}`` / ``{"translation_text"}`` records (or
  ``..._token_ids`` with ``return_tensors=True``), one per returned sequence; a list of texts gives one list per
  text, flattened when each has a single record;
* every text gets the task's prefix from ``config.task_specific_params[task]`` (``"summarize: "``,
  ``"translate English to German: "``), else ``config.prefix``;
* generation settings resolve with transformers 4's priorities: the pipeline's defaults (``max_new_tokens=256``,
  ``num_beams=4``) give way to values the model's generation config sets, then to the pipeline's construction
  arguments, then to the task's ``task_specific_params``; the arguments of a call win over all of them;
* ``truncation``, ``clean_up_tokenization_spaces``, ``return_text``/``return_tensors``, ``stop_sequence``,
  ``batch_size`` and any ``generate`` argument are accepted as there.

Bad input is refused in one line: a batch without a pad token, a source longer than the model's positions can
number (learned absolute positions; pass ``truncation=True``). Plain ``translation`` with no language pair anywhere
translates the texts as they are, as transformers 4 did.
"""

from __future__ import annotations

import copy
import enum
import logging
from typing import Any

import torch
import transformers
from transformers import GenerationConfig

from ..errors import MindFormersError
from ..generation import position_limit
from .base import AcceptsOurModels

logger = logging.getLogger(__name__)

PIPELINE_DEFAULTS = {"max_new_tokens": 256, "num_beams": 4}
"""Generation settings of transformers 4's text-to-text pipelines, used where nothing else sets them."""
_GLOBAL_MAX_LENGTH = 20  # transformers' default max_length: a model config holding another value set it on purpose


class ReturnType(enum.Enum):
    """What each record holds: the token ids or the decoded text."""

    TENSORS = 0
    TEXT = 1


def _global_default(key: str) -> Any:
    """transformers' default value of a generation setting (None for tokens and settings without one)."""
    return GenerationConfig._get_default_generation_params().get(key)


def _value(config: GenerationConfig, key: str) -> Any:
    """A setting's effective value: an unset (None) setting means transformers' default."""
    value = getattr(config, key, None)
    return _global_default(key) if value is None else value


def _merge_model_defaults(config: GenerationConfig, model_config: GenerationConfig) -> GenerationConfig:
    """transformers 4's ``use_model_defaults``: every setting of ``config`` still at transformers' default takes the
    model's generation-config value when the model sets one (a value other than the default)."""
    for key, model_value in model_config.to_dict().items():
        if key.startswith("_") or key == "transformers_version" or model_value is None:
            continue
        default = _global_default(key)
        if _value(config, key) == default and model_value != default:
            setattr(config, key, model_value)
    return config


class Text2TextGenerationPipeline(AcceptsOurModels, transformers.Pipeline):
    """``pipeline("text2text-generation")``: each text through an encoder-decoder's ``generate``; records keyed
    ``generated_text`` (or ``generated_token_ids``)."""

    _pipeline_calls_generate = True
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    return_name = "generated"
    """Prefix of the output keys: ``{return_name}_text`` / ``{return_name}_token_ids``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generation_config = self._pipeline_generation_config()

    def _pipeline_generation_config(self) -> GenerationConfig:
        """The pipeline's own generation settings, resolved as transformers 4 resolved them at construction."""
        config = GenerationConfig(**PIPELINE_DEFAULTS)
        _merge_model_defaults(config, self.model.generation_config)
        init = {k: v for k, v in getattr(self, "_generate_kwargs", {}).items() if k != "generation_config"}
        config.update(**init)
        if config.max_new_tokens == PIPELINE_DEFAULTS["max_new_tokens"] and config.max_length not in (None, _GLOBAL_MAX_LENGTH):
            config.max_new_tokens = None  # a model's own max_length (not transformers' default) is honoured
        task_params = dict((getattr(self.model.config, "task_specific_params", None) or {}).get(self.task) or {})
        if "prefix" in task_params:
            self.prefix = task_params.pop("prefix")
        config.update(**task_params)
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None and config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id
        return config

    def _sanitize_parameters(self, return_tensors: bool | None = None, return_text: bool | None = None,
                             return_type: ReturnType | None = None, clean_up_tokenization_spaces: bool | None = None,
                             truncation: Any = None, stop_sequence: str | None = None, **generate_kwargs: Any):
        preprocess = {} if truncation is None else {"truncation": truncation}
        postprocess: dict[str, Any] = {}
        if return_tensors is not None and return_type is None:
            return_type = ReturnType.TENSORS if return_tensors else ReturnType.TEXT
        if return_type is not None:
            postprocess["return_type"] = return_type
        if clean_up_tokenization_spaces is not None:
            postprocess["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        if stop_sequence is not None:
            ids = self.tokenizer.encode(stop_sequence, add_special_tokens=False)
            if len(ids) > 1:
                logger.warning("stop_sequence %r is %d tokens; generation stops at its first token", stop_sequence, len(ids))
            generate_kwargs["eos_token_id"] = ids[0]
        return preprocess, generate_kwargs, postprocess

    def __call__(self, *args: str | list[str], **kwargs: Any) -> list[dict[str, Any]] | list[list[dict[str, Any]]]:
        """Generate for a text or a list of texts; returns one list of records per text (a flat list of records for a
        list of texts that each give one)."""
        result = super().__call__(*args, **kwargs)
        if isinstance(args[0], list) and all(isinstance(t, str) for t in args[0]) and all(len(r) == 1 for r in result):
            return [r[0] for r in result]
        return result

    def preprocess(self, inputs: str | list[str], truncation: Any = False, **kwargs: Any) -> dict[str, torch.Tensor]:
        return self._parse_and_tokenize(inputs, truncation=truncation)

    def _parse_and_tokenize(self, inputs: str | list[str], truncation: Any) -> dict[str, torch.Tensor]:
        """Prefix and tokenize one text (or pad a list of texts into one batch)."""
        prefix = self.prefix or ""
        if isinstance(inputs, list):
            if self.tokenizer.pad_token_id is None:
                raise MindFormersError("a batch of texts needs a tokenizer with a pad token; set tokenizer.pad_token")
            texts, padding = [prefix + text for text in inputs], True
        elif isinstance(inputs, str):
            texts, padding = prefix + inputs, False
        else:
            raise MindFormersError(f"inputs of type {type(inputs).__name__} are not valid; pass a text or a list of texts")
        encoded = self.tokenizer(texts, padding=padding, truncation=truncation, return_tensors="pt")
        encoded.pop("token_type_ids", None)
        return encoded

    def check_inputs(self, input_length: int, min_length: int, max_length: int) -> None:
        """Task-specific warnings about the lengths (none for plain text-to-text)."""

    def _generation_config_for(self, generate_kwargs: dict[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
        """This call's generation config (transformers 4's ``generate`` priorities) and the remaining arguments."""
        config = copy.deepcopy(generate_kwargs.pop("generation_config", None) or self.generation_config)
        _merge_model_defaults(config, self.model.generation_config)
        rest = config.update(**generate_kwargs)
        return config, rest

    def _forward(self, model_inputs: dict[str, torch.Tensor], **generate_kwargs: Any) -> dict[str, torch.Tensor]:
        rows, input_length = model_inputs["input_ids"].shape
        config, rest = self._generation_config_for(dict(generate_kwargs))
        max_length = config.max_length if config.max_length is not None else _GLOBAL_MAX_LENGTH
        self.check_inputs(input_length, _value(config, "min_length"), max_length)
        limit = position_limit(self.model.config)
        if limit is not None and input_length > limit:
            raise MindFormersError(f"the input has {input_length} tokens, more than the model's limit "
                                   f"max_position_embeddings={limit}; pass truncation=True to cut it")
        output_ids = self.model.generate(**model_inputs, generation_config=config, **rest)
        return {"output_ids": output_ids.reshape(rows, output_ids.shape[0] // rows, *output_ids.shape[1:])}

    def postprocess(self, model_outputs: dict[str, torch.Tensor], return_type: ReturnType = ReturnType.TEXT,
                    clean_up_tokenization_spaces: bool = False) -> list[dict[str, Any]]:
        records = []
        for output_ids in model_outputs["output_ids"][0]:
            if return_type == ReturnType.TENSORS:
                records.append({f"{self.return_name}_token_ids": output_ids})
            else:
                text = self.tokenizer.decode(output_ids, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=clean_up_tokenization_spaces)
                records.append({f"{self.return_name}_text": text})
        return records


class SummarizationPipeline(Text2TextGenerationPipeline):
    """``pipeline("summarization")``: records keyed ``summary_text``; the ``summarization`` entry of
    ``task_specific_params`` (T5's ``"summarize: "`` prefix and its beam settings) applies."""

    return_name = "summary"

    def check_inputs(self, input_length: int, min_length: int, max_length: int) -> None:
        if max_length < min_length:
            logger.warning("min_length=%d is larger than max_length=%d", min_length, max_length)
        if input_length < max_length:
            logger.warning("max_length=%d is longer than the input (%d tokens); summaries are usually shorter than "
                           "their input: consider max_length=%d", max_length, input_length, input_length // 2)


class TranslationPipeline(Text2TextGenerationPipeline):
    """``pipeline("translation_xx_to_yy")``: records keyed ``translation_text``; the task's entry of
    ``task_specific_params`` (T5's ``"translate English to German: "`` prefix) applies. Plain ``"translation"``
    takes the first language pair the model's ``task_specific_params`` lists, as transformers 4 did; with none it
    translates the texts as they are (no prefix, or ``config.prefix``), as transformers 4 did too."""

    return_name = "translation"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        task = kwargs.get("task") or "translation"
        model = kwargs.get("model")
        if task == "translation" and model is not None:
            pairs = [k for k in (getattr(model.config, "task_specific_params", None) or {}) if k.startswith("translation_")]
            if pairs:
                logger.warning("task 'translation' names no language pair; using %r from the model's task_specific_params",
                               pairs[0])
                kwargs["task"] = pairs[0]
        super().__init__(*args, **kwargs)

    def check_inputs(self, input_length: int, min_length: int, max_length: int) -> None:
        if input_length > 0.9 * max_length:
            logger.warning("the input (%d tokens) is longer than 0.9 x max_length=%d; consider a larger max_length",
                           input_length, max_length)

    def _sanitize_parameters(self, src_lang: str | None = None, tgt_lang: str | None = None, **kwargs: Any):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if src_lang is None and tgt_lang is None:
            parts = (kwargs.get("task") or self.task or "").split("_")
            if len(parts) == 4 and parts[0] == "translation" and parts[2] == "to":
                src_lang, tgt_lang = parts[1], parts[3]
        if src_lang is not None:
            preprocess["src_lang"] = src_lang
        if tgt_lang is not None:
            preprocess["tgt_lang"] = tgt_lang
        return preprocess, forward, postprocess

    def preprocess(self, inputs: str | list[str], truncation: Any = False, src_lang: str | None = None,
                   tgt_lang: str | None = None) -> dict[str, torch.Tensor]:
        build = getattr(self.tokenizer, "_build_translation_inputs", None)
        if build is not None:  # multilingual tokenizers put the language codes in themselves
            return build(inputs, return_tensors="pt", truncation=truncation, src_lang=src_lang, tgt_lang=tgt_lang)
        return self._parse_and_tokenize(inputs, truncation=truncation)
