"""Encoder pipelines: ``fill-mask`` and ``feature-extraction``, transformers' own pipelines (same inputs, arguments
and outputs: ``top_k``/``targets`` and ``{"score", "token", "token_str", "sequence"}`` for fill-mask; the hidden
states as nested lists, ``return_tensors``, ``tokenize_kwargs`` for feature extraction) accepting our models."""

from __future__ import annotations

import transformers

from .base import AcceptsOurModels


class FillMaskPipeline(AcceptsOurModels, transformers.FillMaskPipeline):
    """transformers' ``FillMaskPipeline`` on our masked language models."""


class FeatureExtractionPipeline(AcceptsOurModels, transformers.FeatureExtractionPipeline):
    """transformers' ``FeatureExtractionPipeline`` on our base models (the last hidden states of every token)."""
