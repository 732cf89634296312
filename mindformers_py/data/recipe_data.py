"""How a recipe prepares its datasets, one function per task (named by the task registry's ``recipe_data``).

Each function takes the recipe's ``data`` section (any object with its fields: ``source``, ``train_files``,
``validation_files``, ``format``, ``text_column``, ``text_pair_column``, ``label_column``, ``block_size``,
``max_files``, ``max_eval_samples``, and for images ``image_column``, ``augment``, ``augment_seed``), the task's
processing class (the tokenizer, or the image processor) and the model config, and returns a :class:`RecipeData`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import datasets
from torch.utils.data import Subset

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
    baselines: dict[str, list[str]] = field(default_factory=dict)
    """Predictions of simple baselines for each validation row (seq2seq: copying the function name), which the
    recipe scores with the task's metrics beside the model's."""
    references: list[str] | None = None
    """The validation rows' target texts (seq2seq), for scoring the baselines."""
    collator: Any = None
    """The collator the rows need (packed rows keep their positions and get no attention mask), or None for the
    task's own."""


def _cap(validation: Any, data: Any) -> Any:
    if validation is not None and data.max_eval_samples is not None:
        keep = range(min(len(validation), data.max_eval_samples))
        validation = validation.select(keep) if hasattr(validation, "select") else Subset(validation, keep)
    return validation


def _document_options(data: Any) -> dict[str, bool]:
    """Megatron's document options of the data section (all False: plain GPT-2 blocks)."""
    return {name: bool(getattr(data, name, False)) for name in ("reset_position_ids", "reset_attention_mask",
                                                                "eod_mask_loss")}


def _rows_collator(data: Any, tokenizer: Any) -> Any:
    """The collator of packed rows when the rows carry positions (document masks), else None (the task's)."""
    from .sft_packing import PackedRowsCollator

    documents = data.source == "megatron" or data.reset_position_ids or getattr(data, "packing", False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PackedRowsCollator(pad_token_id=pad or 0) if documents else None


def _mixed(data: Any, build: Any) -> datasets.Dataset:
    """The training rows ``build(files)`` makes from ``data.train_files``: all of them, or, with
    ``data.train_weights``, each entry's rows mixed by the weights (:func:`~mindformers_py.data.megatron.blending.mix_datasets`)."""
    if not data.train_weights:
        return build(data.train_files)
    from .megatron.blending import mix_datasets

    entries = data.train_files if isinstance(data.train_files, list) else [data.train_files]
    return mix_datasets([build(entry) for entry in entries], data.train_weights)


def causal_lm_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """Text packed into ``block_size``-token blocks: the standard library's source (``source: stdlib``, split by
    file) or the recipe's files; with ``objective: instructions``, prompt / response pairs scored on the response
    (:mod:`~mindformers_py.data.stdlib.instructions`): the stdlib's docstring -> function pairs, or the recipe's files'
    ``text_column`` (prompt) -> ``target_column`` (response)."""
    if data.objective == "instructions":
        return _instruction_data(data, tokenizer)
    if data.objective is not None:
        raise ConfigError(f"data.objective={data.objective!r} is not valid for causal language modelling; choose one "
                          "of: 'instructions', or leave it out for packed text")
    if data.source == "megatron":
        return _megatron_data(data, tokenizer)
    packed = _packed_text(data, tokenizer, **_document_options(data))
    packed.collator = _rows_collator(data, tokenizer)
    return packed


def _megatron_data(data: Any, tokenizer: Any) -> RecipeData:
    """Samples of Megatron indexed datasets (``data.data_path``, ``data.split``, ``data.seed``), as Megatron-Core's
    ``GPTDataset`` / ``BlendedDataset`` draw them (:mod:`~mindformers_py.data.megatron.blending`): ``data.train_samples``
    training samples, and one epoch of the validation split (``data.max_eval_samples`` of it when set)."""
    from .megatron.blending import build_megatron_datasets
    from .megatron.gpt_dataset import GPTSampleOptions

    options = GPTSampleOptions(data.block_size, seed=data.seed, eod_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, **_document_options(data))
    train, validation, _ = build_megatron_datasets(data.data_path, data.split,
                                                   [data.train_samples, data.max_eval_samples, None], options,
                                                   splits=("train", "valid"))
    if train is None:
        raise ConfigError(f"data.split={data.split!r} leaves no training data; give the first share a weight")
    return RecipeData(train, validation, {}, collator=_rows_collator(data, tokenizer))


def _packed_text(data: Any, tokenizer: Any, **documents: bool) -> RecipeData:
    """The recipe's text (the stdlib's source, split by file, or its files) packed into ``block_size``-token blocks,
    validation capped to ``max_eval_samples``: causal LM pretraining, and the text T5's span corruption corrupts.
    ``documents``: Megatron's document options (:func:`~mindformers_py.data.packing.pack_dataset`)."""
    if data.source == "stdlib":
        train, validation = default_pretraining_data(tokenizer, data.block_size, max_files=data.max_files, **documents)
    else:
        def packed(files):
            return pack_dataset(load_text_files(files, format=data.format), tokenizer, data.block_size,
                                text_column=data.text_column, **documents)

        train = _mixed(data, packed)
        validation = packed(data.validation_files) if data.validation_files else None
    return RecipeData(train, _cap(validation, data), {})


def _instruction_data(data: Any, tokenizer: Any) -> RecipeData:
    from .stdlib.instructions import docstring_instructions, tokenize_instructions

    if data.source == "stdlib":
        raw = {split: docstring_instructions(split, data.max_files) for split in ("train", "validation")}
        columns = ("prompt", "response")
    elif data.source == "files":
        raw = {"train": _mixed(data, lambda files: load_text_files(files, format=data.format))}
        if data.validation_files:
            raw["validation"] = load_text_files(data.validation_files, format=data.format)
        columns = (data.text_column, data.target_column)
    else:
        raise ConfigError(f"data.source={data.source!r} is not valid for data.objective='instructions'; choose one of: "
                          "'stdlib' (docstring -> function pairs), 'files' (data.text_column -> data.target_column)")
    encoded = {name: tokenize_instructions(split, tokenizer, data.block_size, *columns) for name, split in raw.items()}
    if data.packing:  # first-fit decreasing into block_size rows; evaluation keeps one sample per row
        from .sft_packing import pack_samples

        encoded["train"] = pack_samples(encoded["train"].remove_columns("attention_mask"), data.block_size)
        return RecipeData(encoded["train"], _cap(encoded.get("validation"), data), {},
                          collator=_rows_collator(data, tokenizer))
    return RecipeData(encoded["train"], _cap(encoded.get("validation"), data), {})


def masked_lm_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """``[CLS] ... [SEP]`` blocks of ``block_size`` tokens from the standard library's source (``source: stdlib``,
    split by file) or the recipe's files; the task's collator masks them per sample
    (:class:`~mindformers_py.data.masking.DataCollatorForMaskedLM`)."""
    from .masked_lm import default_masked_lm_data, masked_lm_blocks

    if data.source == "stdlib":
        train, validation = default_masked_lm_data(tokenizer, data.block_size, max_files=data.max_files)
    elif data.source == "files":
        def blocks(files):
            return masked_lm_blocks(load_text_files(files, format=data.format), tokenizer, data.block_size,
                                    text_column=data.text_column)

        train = blocks(data.train_files)
        validation = blocks(data.validation_files) if data.validation_files else None
    else:
        raise ConfigError(f"data.source={data.source!r} is not valid for masked language modelling; choose one of: "
                          "'stdlib', 'files'")
    return RecipeData(train, _cap(validation, data), {})


def sequence_classification_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """Rows of ``text_column`` (and ``text_pair_column``) with a ``label_column`` from the recipe's files (csv,
    json/jsonl), or the standard library's docstrings labelled by package (``source: stdlib_docstrings``,
    :mod:`~mindformers_py.data.stdlib.docstrings`), tokenized and truncated to ``block_size`` tokens (a text pair by
    transformers' ``longest_first`` rule: the longer text loses tokens first). String labels are numbered in sorted
    order and become the config's ``id2label``; integer labels are taken as class ids; float labels make a
    regression."""
    if data.source == "stdlib_docstrings":
        from .stdlib.docstrings import stdlib_docstrings

        raw = dict(stdlib_docstrings())
    elif data.source == "files":
        splits = {"train": data.train_files}
        if data.validation_files:
            splits["validation"] = data.validation_files
        raw = {name: load_text_files(files, format=data.format) for name, files in splits.items()}
    else:
        raise ConfigError(f"data.source={data.source!r} is not valid for sequence classification; choose one of: "
                          "'files' (with data.text_column and data.label_column), 'stdlib_docstrings'")
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


def seq2seq_data(data: Any, tokenizer: Any, config: Any) -> RecipeData:
    """Encoder-decoder samples (``input_ids`` and ``labels``) by ``data.objective``:

    * ``span_corruption``: the text (stdlib, split by file, or the recipe's files) packed into blocks of
      ``block_size`` tokens, each corrupted by T5's span corruption as a function of (``data.seed``, row);
    * ``docstrings``: stdlib functions' source (``data.source_prefix`` in front, ``block_size`` tokens) -> the
      first line of their docstring (``max_target_length`` tokens), split by file; baseline: the function's name;
    * ``pairs``: the recipe's files, ``text_column`` -> ``target_column``.

    A ``source_prefix`` is recorded in the config's ``task_specific_params`` (``summarization`` for docstrings, else
    ``text2text-generation``), so the task's pipeline prefixes its inputs the same way."""
    from .stdlib.code_summaries import stdlib_docstring_dataset
    from .span_corruption import span_corruption_dataset
    from .tokenizers.t5 import sentinel_ids

    objective = data.objective
    if objective in (None, "instructions"):
        raise ConfigError(f"data.objective={objective!r} is not valid for a seq2seq recipe; choose one of: "
                          "'span_corruption', 'docstrings', 'pairs'")
    if objective == "span_corruption":
        sentinels = sentinel_ids(tokenizer)
        if not sentinels:
            raise ConfigError("data.objective='span_corruption' needs a tokenizer with sentinel tokens (<extra_id_0>, "
                              "...); set tokenizer.type: t5")
        blocks = _packed_text(data, tokenizer)

        def corrupt(split: datasets.Dataset) -> datasets.Dataset:
            return span_corruption_dataset(split, sentinels, tokenizer.eos_token_id, data.seed, data.noise_density,
                                           data.mean_noise_span_length)

        validation = corrupt(blocks.validation) if blocks.validation is not None else None
        return RecipeData(corrupt(blocks.train), validation, {})
    if objective == "docstrings":
        raw = {split: stdlib_docstring_dataset(split, data.max_files) for split in ("train", "validation")}
        source, target, task = "source", "summary", "summarization"
    else:
        splits = {"train": data.train_files, **({"validation": data.validation_files} if data.validation_files else {})}
        raw = {name: load_text_files(files, format=data.format) for name, files in splits.items()}
        source, target, task = data.text_column, data.target_column, "text2text-generation"
        for name, split in raw.items():
            missing = [c for c in (source, target) if c not in split.column_names]
            if missing:
                field_name = "text_column" if missing[0] == source else "target_column"
                raise ConfigError(f"data.{field_name}={missing[0]!r} is not a column of the {name} files; columns: "
                                  f"{', '.join(split.column_names)}")
    if raw.get("validation") is not None:
        raw["validation"] = _cap(raw["validation"], data)

    def encode(batch):
        out = tokenizer([data.source_prefix + text for text in batch[source]], truncation=True,
                        max_length=data.block_size)
        out["labels"] = tokenizer(batch[target], truncation=True, max_length=data.max_target_length)["input_ids"]
        out.pop("token_type_ids", None)
        return out

    encoded = {name: split.map(encode, batched=True, remove_columns=split.column_names) for name, split in raw.items()}
    updates = {"task_specific_params": {task: {"prefix": data.source_prefix}}} if data.source_prefix else {}
    validation = raw.get("validation")
    baselines = {"function_name": [name.replace("_", " ").strip() for name in validation["name"]]} \
        if objective == "docstrings" and validation is not None else {}
    return RecipeData(encoded["train"], encoded.get("validation"), updates, baselines,
                      list(validation[target]) if validation is not None else None)



RECIPE_DATA = {"causal_lm_data": causal_lm_data, "masked_lm_data": masked_lm_data,
               "sequence_classification_data": sequence_classification_data,
               "image_classification_data": image_classification_data, "seq2seq_data": seq2seq_data}
"""Name (the task registry's ``recipe_data``) -> function."""
