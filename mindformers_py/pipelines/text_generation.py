"""Text generation: transformers' ``TextGenerationPipeline`` with our models and a context-aware length default."""

from __future__ import annotations

from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..generation import check_context_length
from ..models import registry


class TextGenerationPipeline(transformers.TextGenerationPipeline):
    """transformers' text-generation pipeline (same inputs, arguments and outputs) that also:

    - accepts our causal LMs without transformers logging them as unsupported;
    - when neither the call, the pipeline nor the model's generation config sets ``max_new_tokens``/``max_length``,
      lowers the pipeline's default ``max_new_tokens`` so prompt + new tokens fit the model's context;
    - raises a one-line :class:`~mindformers_py.MindFormersError` before generating when the prompt and the requested
      new tokens do not fit the context (naming the prompt length, ``max_new_tokens`` and the context length).
    """

    def check_model_type(self, supported_models: list[str] | dict) -> None:
        """transformers' check, with our families' causal LMs counted as supported."""
        if supported_models is MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            ours = [f.model_classes["causal_lm"].__name__ for f in registry.FAMILIES if "causal_lm" in f.model_classes]
            supported_models = [*supported_models.values(), *ours]
        super().check_model_type(supported_models)

    def _forward(self, model_inputs: dict[str, Any], **generate_kwargs: Any) -> dict[str, Any]:
        context = getattr(self.model.config, "max_position_embeddings", None)
        prompt_length = model_inputs["input_ids"].shape[1]
        if context is not None and prompt_length > 0:
            merged = generate_kwargs if "generation_config" in generate_kwargs else {**self._generate_kwargs, **generate_kwargs}
            requested = self._get_set_generation_params(merged)
            prefix_length = generate_kwargs.get("prefix_length", 0)
            if requested.get("max_new_tokens") is not None:
                new = requested["max_new_tokens"]
            elif requested.get("max_length") is not None:
                new = requested["max_length"] + prefix_length - prompt_length
            else:
                default = self._generation_defaults.get("max_new_tokens")
                new = min(default, context - prompt_length) if default is not None else None
                if new is not None and new > 0:
                    generate_kwargs = {**generate_kwargs, "max_new_tokens": new}
            if new is not None:
                check_context_length(prompt_length, prompt_length + new, context, new)
        return super()._forward(model_inputs, **generate_kwargs)
