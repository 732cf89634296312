"""Masked-LM pretraining blocks: documents packed into ``[CLS] ... [SEP]`` blocks, masked later by the collator.

Documents are tokenised without special tokens, each followed by ``[SEP]``, concatenated and cut into
``block_size - 2`` token pieces (:func:`~mindformers_py.data.packing.pack_dataset`), and every piece is wrapped as
``[CLS] piece [SEP]``: fixed-length rows, no padding, a single segment (RoBERTa's FULL-SENTENCES input without the
next-sentence task). Masking is left to :class:`~mindformers_py.data.masking.DataCollatorForMaskedLM`, per sample.
"""

from __future__ import annotations

import os
import platform

import datasets
from transformers import PreTrainedTokenizerBase

from ..errors import MindFormersError
from .cache import atomic_dir, fingerprint, resolve_cache_dir
from .corpus import SPLITS, stdlib_corpus, stdlib_files, stdlib_root
from .packing import pack_dataset
from .pretraining import tokenizer_fingerprint

_CACHE_FORMAT = 1  # bump when the block layout changes so old cache entries are not reused


def masked_lm_blocks(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, block_size: int,
                     text_column: str = "text", num_proc: int | None = None) -> datasets.Dataset:
    """``[CLS] tokens [SEP]`` rows of exactly ``block_size`` ids (column ``input_ids``) from the documents of
    ``dataset[text_column]``."""
    for name in ("cls_token_id", "sep_token_id", "mask_token_id"):
        if getattr(tokenizer, name, None) is None:
            raise MindFormersError(f"tokenizer {type(tokenizer).__name__} has no {name.removesuffix('_id')}, which "
                                   "masked-LM blocks need; use a BERT-style tokenizer (tokenizer.type: wordpiece)")
    if block_size < 3:
        raise MindFormersError(f"block_size={block_size} leaves no room between [CLS] and [SEP]; use at least 3")
    pieces = pack_dataset(dataset, tokenizer, block_size - 2, text_column=text_column, num_proc=num_proc,
                          separator_id=tokenizer.sep_token_id)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    return pieces.map(lambda batch: {"input_ids": [[cls, *ids, sep] for ids in batch["input_ids"]]}, batched=True,
                      remove_columns=pieces.column_names, desc="Adding [CLS]/[SEP]",
                      features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64"), length=block_size)}))


def default_masked_lm_data(tokenizer: PreTrainedTokenizerBase, block_size: int, max_files: int | None = None,
                           cache_dir: str | os.PathLike[str] | None = None, validation_fraction: float = 0.05,
                           ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, validation)`` blocks of the stdlib corpus (split by file), cached on disk under a fingerprint of the
    tokenizer, ``block_size``, the file lists and the Python version (later calls load them memory-mapped)."""
    root = stdlib_root()
    files = {split: [(p.relative_to(root).as_posix(), p.stat().st_size)
                     for p in stdlib_files(split, max_files, validation_fraction)] for split in SPLITS}
    key = fingerprint(_CACHE_FORMAT, platform.python_implementation(), platform.python_version(), datasets.__version__,
                      tokenizer_fingerprint(tokenizer), block_size, files)
    folder = resolve_cache_dir(cache_dir) / f"masked-lm-{key}"
    if not all((folder / split).is_dir() for split in SPLITS):
        with atomic_dir(folder) as tmp:
            for split in SPLITS:
                corpus = stdlib_corpus(split, max_files, validation_fraction)
                masked_lm_blocks(corpus, tokenizer, block_size).save_to_disk(os.fspath(tmp / split))
    train, validation = (datasets.load_from_disk(os.fspath(folder / split)) for split in SPLITS)
    return train, validation
