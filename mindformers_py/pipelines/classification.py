"""Text and token classification: transformers' pipelines (same inputs, arguments and outputs: ``label``/``score``,
``top_k``, ``function_to_apply``; entities with ``aggregation_strategy``) accepting our models."""

from __future__ import annotations

import transformers

from .base import AcceptsOurModels


class TextClassificationPipeline(AcceptsOurModels, transformers.TextClassificationPipeline):
    """transformers' ``TextClassificationPipeline`` on our sequence classifiers."""


class TokenClassificationPipeline(AcceptsOurModels, transformers.TokenClassificationPipeline):
    """transformers' ``TokenClassificationPipeline`` on our token classifiers."""
