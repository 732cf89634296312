"""Images for image classification: ``datasets`` datasets with ``Image`` features (scikit-learn's bundled handwritten
digits, or a user's folders through the ``imagefolder`` loader), turned into model inputs by the model's image
processor, with seeded augmentation.

:class:`ImageClassificationDataset` applies the image processor as the transform of each example (transformers'
``ViTImageProcessor``: resize, rescale, normalise) and, for training, a random affine transformation from kornia.
Each example's augmentation is seeded by (seed, epoch, example index), never by the order examples are read in, so
every parallel layout, data-loader worker count and resumed run sees the very same images; the Trainer announces
each epoch through ``set_epoch``, as accelerate does for transformers' Trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import datasets
import numpy as np
import torch

from ..errors import ConfigError, MindFormersError
from ..layers.loss import IGNORE_INDEX

# transformers' ViT processor defaults (IMAGENET_STANDARD_MEAN/STD): pixels in [0, 1] become [-1, 1].
DEFAULT_MEAN, DEFAULT_STD = 0.5, 0.5
PIL_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
"""num_channels -> the PIL mode images are converted to before the processor."""


def default_image_processor(config: Any, image_mean: Sequence[float] | None = None,
                            image_std: Sequence[float] | None = None, **kwargs: Any):
    """transformers' ``ViTImageProcessor`` for a model config with ``image_size`` and ``num_channels``: resize to
    ``image_size`` (bilinear), rescale by 1/255, normalise by ``image_mean``/``image_std`` (one value per channel;
    default 0.5, transformers' ViT defaults). ``kwargs`` are further processor settings. This is transformers' PIL
    backend of the processor (its torchvision backend needs torchvision, which does not install beside the pinned
    torch); it saves as ``ViTImageProcessor`` in ``preprocessor_config.json``."""
    from transformers import ViTImageProcessorPil

    size = config.image_size
    height, width = (size, size) if isinstance(size, int) else size
    channels = config.num_channels
    return ViTImageProcessorPil(size={"height": height, "width": width},
                                image_mean=list(image_mean or [DEFAULT_MEAN] * channels),
                                image_std=list(image_std or [DEFAULT_STD] * channels), **kwargs)


def digits_dataset(validation_fraction: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """scikit-learn's bundled handwritten digits (1797 grayscale 8x8 images of 0-9, shipped with the package: no
    download) as a ``DatasetDict`` with ``train`` and ``validation`` splits (stratified by class, ``seed`` fixed, so
    every run holds out the same images), columns ``image`` (an ``Image`` feature, PIL mode ``L``, 0-255) and
    ``label`` (a ``ClassLabel`` named "0".."9")."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)  # the data's 0-16 ink levels as 8-bit gray
    labels = digits.target.astype(int)
    train_idx, val_idx = train_test_split(np.arange(len(labels)), test_size=validation_fraction, stratify=labels,
                                          random_state=seed)
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[str(d) for d in range(10)])})

    def split(indices: np.ndarray) -> datasets.Dataset:
        indices = np.sort(indices)
        return datasets.Dataset.from_dict({"image": [Image.fromarray(pixels[i], mode="L") for i in indices],
                                           "label": labels[indices].tolist()}, features=features)

    return datasets.DatasetDict(train=split(train_idx), validation=split(val_idx))


def imagefolder_dataset(folder: str | Path) -> datasets.Dataset:
    """A folder of class sub-folders (``folder/cat/1.png``, ``folder/dog/2.jpg``, ...) as a ``datasets.Dataset``
    through the ``imagefolder`` loader: columns ``image`` and ``label`` (a ``ClassLabel`` of the sub-folder names)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"image folder {folder} does not exist or is not a folder; expected class sub-folders of images")
    try:
        return datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"no images found in {folder} ({str(err).splitlines()[0]}); expected class sub-folders of "
                          "images") from None


def label_names(dataset: datasets.Dataset, label_column: str = "label") -> list[str] | None:
    """The class names of a ``ClassLabel`` column, or None for plain integer labels."""
    feature = dataset.features.get(label_column)
    return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def example_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one example's random transformation: a function of the run's seed, the epoch and the example's
    index only (NumPy's ``SeedSequence`` mixes them so nearby triples give unrelated streams)."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


class RandomAffine:
    """A random rotation, shift and zoom of an image's pixels (kornia's ``RandomAffine``) whose randomness is fully
    given by a seed. Works on pixel values in [0, 1], where 0 is black, so the corners it uncovers are black.

    Args:
        degrees: rotations are drawn from [-degrees, degrees].
        translate: shifts are drawn up to this fraction of the width/height.
        scale: zoom factors are drawn from this range.
    """

    def __init__(self, degrees: float = 10.0, translate: float = 0.1, scale: tuple[float, float] = (0.9, 1.1)) -> None:
        import kornia.augmentation

        self.transform = kornia.augmentation.RandomAffine(degrees=degrees, translate=(translate, translate),
                                                          scale=scale, p=1.0)

    def __call__(self, pixels: torch.Tensor, seed: int) -> torch.Tensor:
        """(C, H, W) pixels in [0, 1] -> transformed pixels, the same for the same seed."""
        with torch.random.fork_rng(devices=[]):  # kornia draws from torch's generator: seed it, leave it as it was
            torch.manual_seed(seed)
            return self.transform(pixels[None])[0]


class ImageClassificationDataset(torch.utils.data.Dataset):
    """Model inputs ``{"pixel_values": (C, H, W), "labels": class id}`` from a ``datasets.Dataset`` of images.

    Each image is converted to the model's channels (grayscale to RGB for an RGB model; PIL's conversion), processed
    by ``image_processor`` and, when ``augmentation`` is given, transformed with the seed of
    :func:`example_seed` ``(seed, epoch, index)`` (augmentation runs on the processed pixels, un-normalised to
    [0, 1] and normalised again, so it happens at the model's resolution).

    Args:
        dataset: a ``datasets.Dataset`` (or any indexable of dicts) with an image column (PIL images, file paths or
            arrays) and a label column.
        image_processor: the model's image processor (``AutoImageProcessor.from_pretrained(checkpoint)``).
        num_channels: the model's ``num_channels``.
        num_labels: the model's ``num_labels``; labels outside 0..num_labels-1 (other than -100) are refused here,
            before any training.
        image_column, label_column: the columns holding the image and its class id.
        augmentation: a seeded transformation such as :class:`RandomAffine`; None for evaluation data.
        seed: the run's augmentation seed.
    """

    def __init__(self, dataset: Any, image_processor: Any, num_channels: int = 3, num_labels: int | None = None,
                 image_column: str = "image", label_column: str = "label", augmentation: RandomAffine | None = None,
                 seed: int = 0) -> None:
        columns = getattr(dataset, "column_names", None)
        for what, column in (("image", image_column), ("label", label_column)):
            if columns is not None and column not in columns:
                raise ConfigError(f"data.{what}_column={column!r} is not a column of the dataset; columns: "
                                  f"{', '.join(columns)}")
        if num_channels not in PIL_MODES:
            raise ConfigError(f"num_channels={num_channels} has no image mode; choose one of: "
                              f"{', '.join(map(str, PIL_MODES))}")
        self.dataset = dataset
        self.image_processor = image_processor
        self.mode = PIL_MODES[num_channels]
        self.image_column, self.label_column = image_column, label_column
        self.augmentation = augmentation
        self.seed = seed
        self.epoch = 0
        if num_labels is not None:
            labels = dataset[label_column] if columns is not None else [row[label_column] for row in dataset]
            check_labels(labels, num_labels)
        normalised = bool(getattr(image_processor, "do_normalize", False))
        self._mean = torch.tensor(image_processor.image_mean).view(-1, 1, 1) if normalised else None
        self._std = torch.tensor(image_processor.image_std).view(-1, 1, 1) if normalised else None

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s augmentation (called by the Trainer at the start of each epoch)."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.dataset[index]
        pixels = self.image_processor(images=self._image(row[self.image_column]), return_tensors="pt")["pixel_values"][0]
        if self.augmentation is not None:
            pixels = self._augmented(pixels, example_seed(self.seed, self.epoch, int(index)))
        return {"pixel_values": pixels, "labels": int(row[self.label_column])}

    def _image(self, image: Any) -> Any:
        """A PIL image in the model's mode (paths opened, arrays wrapped)."""
        from PIL import Image

        if isinstance(image, (str, Path)):
            image = Image.open(image)
        elif isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise MindFormersError(f"the {self.image_column!r} column holds {type(image).__name__}; expected images "
                                   "(a datasets Image feature, PIL images, file paths or arrays)")
        return image if image.mode == self.mode else image.convert(self.mode)

    def _augmented(self, pixels: torch.Tensor, seed: int) -> torch.Tensor:
        if self._mean is None:
            return self.augmentation(pixels, seed)
        return (self.augmentation(pixels * self._std + self._mean, seed) - self._mean) / self._std


def check_labels(labels: Sequence[int], num_labels: int) -> None:
    """Refuse class ids outside 0..num_labels-1 (-100 marks a row to ignore) with a one-line error."""
    values = np.asarray(labels)
    if values.dtype.kind not in "iu":
        raise MindFormersError(f"image labels must be class ids (integers); got values of type {values.dtype}")
    bad = ((values < 0) | (values >= num_labels)) & (values != IGNORE_INDEX)
    if bad.any():
        raise MindFormersError(f"label {int(values[bad][0])} is outside num_labels={num_labels} (class ids "
                               f"0..{num_labels - 1}, or -100 to ignore a row)")
