"""Tiny random transformers ViT models and images for the ViT family's tests (built locally, no hub)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

IMAGE, PATCH, LABELS = 16, 4, 3


def tiny_hf_vit(head: str = "image_classification", **overrides) -> torch.nn.Module:
    """A seeded tiny HF ViT (2 layers, width 32, 16x16 images in 4x4 patches) with non-trivial weights: biases and
    norms randomised too, so a mapping mistake cannot hide."""
    torch.manual_seed(1234)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=IMAGE, patch_size=PATCH, num_labels=LABELS,
                                    id2label={i: f"class_{i}" for i in range(LABELS)}, **overrides)
    cls = {"image_classification": transformers.ViTForImageClassification, "base": transformers.ViTModel}[head]
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_vit(folder: Path, head: str = "image_classification", **overrides) -> torch.nn.Module:
    """Save :func:`tiny_hf_vit` with its image processor into ``folder``; returns the HF model."""
    from transformers import ViTImageProcessorPil

    model = tiny_hf_vit(head, **overrides)
    model.save_pretrained(folder)
    ViTImageProcessorPil(size={"height": IMAGE, "width": IMAGE}).save_pretrained(folder)
    return model


def random_images(n: int, size: int = IMAGE, mode: str = "RGB", seed: int = 0) -> list:
    """``n`` random PIL images of ``size`` x ``size`` pixels (of another size than the model's, for the resize)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, len(mode))
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode) for _ in range(n)]
