"""Image classification: transformers' pipeline (same inputs, arguments and outputs: ``label``/``score``, ``top_k``,
``function_to_apply``) accepting our models, and images in every form a user has at hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers

from ..errors import MindFormersError
from .base import AcceptsOurModels


class ImageClassificationPipeline(AcceptsOurModels, transformers.ImageClassificationPipeline):
    """transformers' ``ImageClassificationPipeline`` on our image classifiers. PIL images and file paths are read as
    transformers does (converted to RGB); arrays and tensors, which transformers hands to the image processor as they
    are, are first brought to the model's channels: a grayscale array (H, W) or one with a single channel is repeated
    to RGB for a three-channel model, and other channel counts are refused with a one-line error."""

    def preprocess(self, image: Any, timeout: float | None = None) -> Any:
        if isinstance(image, (np.ndarray, torch.Tensor)):
            image = _to_channels(image, getattr(self.model.config, "num_channels", 3))
        return super().preprocess(image, timeout=timeout)


def _to_channels(image: np.ndarray | torch.Tensor, channels: int) -> np.ndarray | torch.Tensor:
    """``image`` with ``channels`` channels, laid out as it came (channels first or last)."""
    if image.ndim == 2:  # (H, W): grayscale
        image = image[..., None]
    if image.ndim != 3:
        raise MindFormersError(f"an image array of shape {tuple(image.shape)} is not one image; expected (height, width), "
                               "(height, width, channels) or (channels, height, width)")
    first = image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4)
    have = image.shape[0] if first else image.shape[-1]
    if have == channels:
        return image
    if have == 1 and channels == 3:  # grayscale to an RGB model
        reps = (3, 1, 1) if first else (1, 1, 3)
        return image.repeat(*reps) if isinstance(image, torch.Tensor) else np.tile(image, reps)
    raise MindFormersError(f"an image with {have} channels cannot go to a model of num_channels={channels}; convert it "
                           "(grayscale images are converted to RGB, other channel counts are not)")
