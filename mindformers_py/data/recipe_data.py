"""How a recipe prepares its datasets, one function per task (named by the task registry's ``recipe_data``).

Each function takes the recipe's ``data`` section (any object with its fields: ``source``, ``train_files``,
``validation_files``, ``format``, ``text_column``, ``text_pair_column``, ``label_column``, ``block_size``,
``max_files``, ``max_eval_samples``, and for images ``image_column``, ``augment``, ``augment_seed``), the task's
processing class (the tokenizer, or the image processor) and the model config, and returns a :class:`RecipeData`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets

from ..errors import ConfigError
from .corpus import load_text_files
from .packing import pack_dataset
from .pretraining import default_pretraining_data


@dataclass
class RecipeData:
    """The datasets a recipe trains and evaluates on, and what the model config must know about them."""

    train: datasets.Dataset | None
    """Training split (None when the recipe only predicts)."""
    validation: datasets.Dataset | None
    """Validation split, or None."""
    config_updates: dict[str, Any]
    """Model config fields the data decides (a classifier's ``num_labels`` and label names)."""


def _cap(validation: datasets.Dataset | None, data: Any) -> datasets.Dataset | None:
    if validation is not None and data.max_eval_samples is not None:
        validation = validation.select(range(min(len(validation), data.max_eval_samples)))
    return validation


def causal_lm_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """Text packed into ``block_size``-token blocks: the standard library's source (``source: stdlib``, split by
    file) or the recipe's files."""
    if data.source == "stdlib":
        train, validation = default_pretraining_data(tokenizer, data.block_size, max_files=data.max_files)
    else:
        def packed(files):
            return pack_dataset(load_text_files(files, format=data.format), tokenizer, data.block_size,
                                text_column=data.text_column)

        train = packed(data.train_files)
        validation = packed(data.validation_files) if data.validation_files else None
    return RecipeData(train, _cap(validation, data), {})


def sequence_classification_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """Rows of ``text_column`` (and ``text_pair_column``) with a ``label_column`` from the recipe's files (csv,
    json/jsonl), tokenized and truncated to ``block_size`` tokens. String labels are numbered in sorted order and
    become the config's ``id2label``; integer labels are taken as class ids; float labels make a regression."""
    if data.source != "files":
        raise ConfigError(f"data.source={data.source!r} is not valid for sequence classification; choose one of: "
                          "'files' (with data.text_column and data.label_column)")
    splits = {"train": data.train_files}
    if data.validation_files:
        splits["validation"] = data.validation_files
    raw = {name: load_text_files(files, format=data.format) for name, files in splits.items()}
    columns = [data.text_column, data.label_column] + ([data.text_pair_column] if data.text_pair_column else [])
    for name, split in raw.items():
        missing = [c for c in columns if c not in split.column_names]
        if missing:
            raise ConfigError(f"data.{'label' if missing[0] == data.label_column else 'text'}_column={missing[0]!r} "
                              f"is not a column of the {name} files; columns: {', '.join(split.column_names)}")
    values = raw["train"][data.label_column]
    updates: dict[str, Any]
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        index = {n: i for i, n in enumerate(names)}
        updates = {"num_labels": len(names), "id2label": dict(enumerate(names)), "label2id": index}
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        index, updates = None, {"num_labels": max(values) + 1}
    elif all(isinstance(v, (int, float)) for v in values):
        index, updates = None, {"num_labels": 1, "problem_type": "regression"}
    else:
        raise ConfigError(f"data.label_column={data.label_column!r} must hold strings, class ids or numbers in every row")

    def encode(batch):
        pairs = (batch[data.text_pair_column],) if data.text_pair_column else ()
        out = tokenizer(batch[data.text_column], *pairs, truncation=True, max_length=data.block_size)
        labels = batch[data.label_column]
        if index is not None:
            unknown = [v for v in labels if v not in index]
            if unknown:
                raise ConfigError(f"label {unknown[0]!r} of the validation files is not among the training labels: "
                                  f"{', '.join(index)}")
            labels = [index[v] for v in labels]
        out["labels"] = labels
        return out

    encoded = {name: split.map(encode, batched=True, remove_columns=split.column_names) for name, split in raw.items()}
    return RecipeData(encoded["train"], _cap(encoded.get("validation"), data), updates)


def image_classification_data(data: Any, image_processor: Any, config: Any) -> RecipeData:
    """Images with class labels: scikit-learn's bundled digits (``source: digits``) or the recipe's folders of class
    sub-folders (``source: imagefolder``, ``train_files``/``validation_files`` are folders), processed by the model's
    image processor; training images augmented when ``data.augment`` (seeded per image and epoch). The class names
    become the config's ``id2label``."""
    from .images import ImageClassificationDataset, RandomAffine, digits_dataset, imagefolder_dataset, label_names

    if data.source == "digits":
        splits = dict(digits_dataset())
    elif data.source == "imagefolder":
        splits = {"train": imagefolder_dataset(_one_folder(data.train_files, "train_files"))}
        if data.validation_files:
            splits["validation"] = imagefolder_dataset(_one_folder(data.validation_files, "validation_files"))
    else:
        raise ConfigError(f"data.source={data.source!r} is not valid for image classification; choose one of: "
                          "'digits', 'imagefolder'")
    names = label_names(splits["train"], data.label_column)
    if names is not None:
        updates = {"num_labels": len(names), "id2label": dict(enumerate(names)),
                   "label2id": {n: i for i, n in enumerate(names)}}
    else:
        updates = {"num_labels": max(splits["train"][data.label_column]) + 1}
    if "validation" in splits and data.max_eval_samples is not None:
        splits["validation"] = splits["validation"].select(range(min(len(splits["validation"]), data.max_eval_samples)))

    def wrap(split, augment: bool) -> ImageClassificationDataset:
        return ImageClassificationDataset(split, image_processor, num_channels=config.num_channels,
                                          num_labels=updates["num_labels"], image_column=data.image_column,
                                          label_column=data.label_column,
                                          augmentation=RandomAffine() if augment else None, seed=data.augment_seed)

    validation = wrap(splits["validation"], False) if "validation" in splits else None
    return RecipeData(wrap(splits["train"], data.augment), validation, updates)


def _one_folder(value: Any, field: str) -> str:
    """The one folder a ``data.*_files`` field names (a list of one is accepted, as flags give lists)."""
    folders = value if isinstance(value, (list, tuple)) else [value]
    if len(folders) != 1:
        raise ConfigError(f"data.{field}={value!r} must name one folder of class sub-folders for source 'imagefolder'")
    return str(folders[0])


RECIPE_DATA = {"causal_lm_data": causal_lm_data, "sequence_classification_data": sequence_classification_data,
               "image_classification_data": image_classification_data}
"""Name (the task registry's ``recipe_data``) -> function."""
