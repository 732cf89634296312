"""Ready-to-train packed datasets from the default (stdlib) corpus, cached on disk."""

from __future__ import annotations

import hashlib
import os
import platform

import datasets
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from mindformers_py.data.cache import atomic_dir, fingerprint, resolve_cache_dir
from mindformers_py.data.corpus import SPLITS, stdlib_corpus, stdlib_files, stdlib_root
from mindformers_py.data.packing import pack_dataset

_CACHE_FORMAT = 1  # bump when packing changes so old cache entries are not reused


def default_pretraining_data(
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    max_files: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    validation_fraction: float = 0.05,
    num_proc: int | None = None,
    **packing: bool,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, validation)`` stdlib corpus splits packed into ``block_size``-token blocks.

    The packed splits are saved under ``<cache_dir>/packed-<fingerprint>`` (fingerprint of the
    tokenizer's content, ``block_size``, the file lists and the Python version); later calls load them
    memory-mapped in well under a second.

    Args:
        tokenizer: the tokenizer to encode with (e.g. :func:`~mindformers_py.data.tokenizers.bpe_wordpiece.default_tokenizer`).
        block_size: tokens per example (the model's training context length).
        max_files: at most this many files per split (a fixed sample of each); None uses all.
        cache_dir: cache folder; :func:`~mindformers_py.data.cache.default_cache_dir` when None.
        validation_fraction: share of stdlib files held out for validation.
        num_proc: processes for tokenisation on the first (uncached) call.
        **packing: :func:`~mindformers_py.data.packing.pack_dataset`'s Megatron options (``reset_position_ids``,
            ``reset_attention_mask``, ``eod_mask_loss``).

    Returns:
        Train and validation datasets with ``input_ids`` and ``labels`` columns (see
        :func:`~mindformers_py.data.packing.pack_dataset`).
    """
    root = stdlib_root()
    files = {
        split: [
            (p.relative_to(root).as_posix(), p.stat().st_size)
            for p in stdlib_files(split, max_files, validation_fraction)
        ]
        for split in SPLITS
    }
    key = fingerprint(
        _CACHE_FORMAT, platform.python_implementation(), platform.python_version(), datasets.__version__,
        tokenizer_fingerprint(tokenizer), block_size, files,
        *([sorted(packing.items())] if any(packing.values()) else []),  # the plain blocks keep their cache entry
    )
    folder = resolve_cache_dir(cache_dir) / f"packed-{key}"
    if not all((folder / split).is_dir() for split in SPLITS):
        with atomic_dir(folder) as tmp:
            for split in SPLITS:
                corpus = stdlib_corpus(split, max_files, validation_fraction)
                pack_dataset(corpus, tokenizer, block_size, num_proc=num_proc, **packing).save_to_disk(
                    os.fspath(tmp / split))
    train, validation = (datasets.load_from_disk(os.fspath(folder / split)) for split in SPLITS)
    return train, validation


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what determines a tokenizer's output: its full serialisation and eos token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A fast tokenizer's JSON is exact and cheap; slow ones fall back to datasets' pickling hasher.
    content = backend.to_str() if backend is not None else Hasher.hash(tokenizer)
    content += f"|eos={tokenizer.eos_token!r}"
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]
