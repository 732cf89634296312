"""Text generation: transformers' ``TextGenerationPipeline`` with our models and a context-aware length default."""

from __future__ import annotations

from typing import Any

import transformers
from ..generation import check_context_length, position_limit
from .base import AcceptsOurModels


class TextGenerationPipeline(AcceptsOurModels, transformers.TextGenerationPipeline):
    """transformers' text-generation pipeline (same inputs, arguments and outputs) that also:

    - accepts our causal LMs without transformers logging them as unsupported;
    - when neither the call, the pipeline nor the model's generation config sets ``max_new_tokens``/``max_length``,
      lowers the pipeline's default ``max_new_tokens`` so prompt + new tokens fit the model's context;
    - raises a one-line :class:`~mindformers_py.MindFormersError` before generating when the prompt and the requested
      new tokens do not fit the context (naming the prompt length, ``max_new_tokens`` and the context length).
    """

    def _forward(self, model_inputs: dict[str, Any], **generate_kwargs: Any) -> dict[str, Any]:
        context = position_limit(self.model.config)
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
