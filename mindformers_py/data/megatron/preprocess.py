"""``mindformers-py preprocess``: text to Megatron's indexed format, as Megatron-LM's ``tools/preprocess_data.py``.

Each input row is one document; each of its ``json_keys`` is tokenised (the tokenizer's own special tokens
included, as Megatron's ``HuggingFaceTokenizer.tokenize`` does), with the end-of-document token after it when
``append_eod``, and written to ``<output_prefix>_<key>_document.bin/.idx`` (uint16 tokens below 65,500 ids, else
int32; an empty document is kept as a document of no sequence) — the files, names and content Megatron's script
writes, which Megatron-Core's ``IndexedDataset`` reads (tested).

Inputs: JSONL / JSON, Parquet, CSV, text files (one document per file) or a ``datasets`` folder saved with
``save_to_disk``. Tokenisation runs in ``workers`` processes with ``datasets.map``, shows its progress bar, and is
resumable: its shards are cached under ``<output_prefix>.preprocess-cache/`` (keyed by the inputs, the tokenizer and
the options), so a run stopped midway tokenises only the shards it had not finished; the cache goes once the files
are written. The ``.bin``/``.idx`` files are written under temporary names and renamed when complete.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from ...errors import ConfigError, MindFormersError
from ..cache import fingerprint
from ..corpus import load_text_files
from .indexed_dataset import IndexedDatasetWriter, optimal_dtype
from ..pretraining import tokenizer_fingerprint

_FORMAT = 1  # bump when the tokenisation changes, so old shards are not reused
_WRITE_ROWS = 8192  # documents per write: bounded memory however large the corpus


@dataclass
class PreprocessResult:
    """What one ``preprocess`` call wrote."""

    prefixes: dict[str, str]
    """The indexed dataset written for each json key (``<output_prefix>_<key>_document``)."""
    documents: int
    """Documents read."""
    tokens: int
    """Tokens written, over all keys."""
    seconds: float
    """Wall time of the whole call."""


def preprocess(inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], output_prefix: str | os.PathLike[str],
               tokenizer: Any, json_keys: Sequence[str] = ("text",), workers: int = 1, append_eod: bool = False,
               format: str | None = None) -> PreprocessResult:
    """Tokenise ``inputs`` into Megatron indexed datasets (see the module docstring).

    Args:
        inputs: files or glob patterns (jsonl/json, parquet, csv, text), or one ``save_to_disk`` folder.
        output_prefix: path prefix of the outputs (Megatron's ``--output-prefix``).
        tokenizer: a transformers tokenizer.
        json_keys: the text columns to write, one indexed dataset each (Megatron's ``--json-keys``).
        workers: tokenising processes (Megatron's ``--workers``).
        append_eod: put the tokenizer's eos token after every non-empty document (Megatron's ``--append-eod``).
        format: the input format (``json``, ``parquet``, ``csv``, ``text``); None infers it from the extension.

    Raises:
        MindFormersError: an input or column is missing, ``append_eod`` without an eos token, a bad option.
    """
    start = time.perf_counter()
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers={workers!r} must be a positive integer")
    keys = list(json_keys)
    if not keys:
        raise ConfigError("--json-keys is empty; name at least one text column (default: text)")
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise ConfigError(f"--append-eod needs an end-of-document token, and tokenizer {type(tokenizer).__name__} has "
                          "no eos_token")
    table, sources = _load_input(inputs, format)
    missing = [k for k in keys if k not in table.column_names]
    if missing:
        raise ConfigError(f"--json-keys {missing[0]!r} is not a column of the input; its columns: "
                          f"{', '.join(table.column_names)}")
    output_prefix = os.fspath(output_prefix)
    key = fingerprint(_FORMAT, sources, tokenizer_fingerprint(tokenizer), keys, append_eod, len(table))
    cache = Path(f"{output_prefix}.preprocess-cache") / key
    cache.mkdir(parents=True, exist_ok=True)
    tokenized = table.map(
        _encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=table.column_names,
        fn_kwargs={"tokenizer": tokenizer, "keys": keys, "eod": eod if append_eod else None},
        features=datasets.Features({f"{k}_ids": datasets.List(datasets.Value("int32")) for k in keys}),
        cache_file_name=str(cache / "tokens.arrow"), load_from_cache_file=True, desc="Tokenizing")
    dtype = optimal_dtype(len(tokenizer))
    prefixes, total = {}, 0
    for k in keys:
        prefixes[k] = f"{output_prefix}_{k}_document"
        total += _write(tokenized, f"{k}_ids", prefixes[k], dtype)
    del tokenized
    shutil.rmtree(cache.parent, ignore_errors=True)  # written: the shards are not needed to resume any more
    return PreprocessResult(prefixes, len(table), total, time.perf_counter() - start)


def _encode(batch: dict[str, list[Any]], tokenizer: Any, keys: list[str], eod: int | None) -> dict[str, list[list[int]]]:
    out = {}
    for k in keys:
        texts = ["" if t is None else str(t) for t in batch[k]]
        # verbose=False: documents longer than model_max_length are the point here, not a mistake
        ids = tokenizer(texts, return_attention_mask=False, verbose=False)["input_ids"]
        if eod is not None:
            ids = [x + [eod] if x else x for x in ids]
        out[f"{k}_ids"] = ids
    return out


def _write(tokenized: datasets.Dataset, column: str, prefix: str, dtype: type[np.integer]) -> int:
    """Write one column of token lists as an indexed dataset (one sequence per non-empty document); its tokens."""
    from tqdm.auto import tqdm

    data = tokenized.data.column(column)
    written = 0
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for first in tqdm(range(0, len(tokenized), _WRITE_ROWS), desc=f"Writing {Path(prefix).name}", unit="batch",
                          disable=datasets.are_progress_bars_disabled()):
            chunk = data.slice(first, _WRITE_ROWS)
            lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            tokens = pc.list_flatten(chunk).to_numpy(zero_copy_only=False)
            writer.add_documents(tokens, lengths[lengths > 0], (lengths > 0).astype(np.int64))
            written += len(tokens)
    return written


def _load_input(inputs: Any, format: str | None) -> tuple[datasets.Dataset, list]:
    """The input rows and what identifies them for the cache key (each file's path, size and modification time)."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise ConfigError("--input is empty; give files, glob patterns or a saved datasets folder")
    if len(items) == 1 and Path(items[0]).is_dir():
        folder = Path(items[0])
        if not (folder / "state.json").is_file() and not (folder / "dataset_dict.json").is_file():
            raise MindFormersError(f"--input {str(folder)!r} is a folder but not a datasets save_to_disk folder; give "
                                   "files or glob patterns")
        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        stamp = [(str(folder.resolve()), loaded._fingerprint)]
        return loaded, stamp
    files = sorted({f for item in items for f in _expand(os.fspath(item))})
    stamp = [(str(Path(f).resolve()), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    if format == "parquet" or (format is None and all(f.lower().endswith(".parquet") for f in files)):
        return datasets.load_dataset("parquet", data_files=files, split="train"), stamp
    kwargs = {}
    if format == "text" or (format is None and all(os.path.splitext(f)[1] in (".txt", ".text", ".md") for f in files)):
        kwargs["sample_by"] = "document"  # a text file is one document
    return load_text_files(files, format=format, **kwargs), stamp


def _expand(pattern: str) -> list[str]:
    import glob

    expanded = os.path.expanduser(pattern)
    found = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
    if not found or not all(os.path.isfile(f) for f in found):
        what = "matches no file" if glob.has_magic(expanded) else "is not a file"
        raise MindFormersError(f"--input {pattern!r} {what}")
    return found


TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer")
"""Megatron ``--tokenizer-type`` values ``preprocess`` takes."""


def load_preprocess_tokenizer(name_or_path: str | None, tokenizer_type: str = "HuggingFaceTokenizer",
                              vocab_file: str | None = None, merge_file: str | None = None) -> Any:
    """The tokenizer Megatron's flags name: ``HuggingFaceTokenizer`` from a folder or hub name (``--tokenizer`` or
    ``--tokenizer-model``), or ``GPT2BPETokenizer`` from ``--vocab-file`` and ``--merge-file``."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    from ...utils.damaged_files import loading_from

    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type={tokenizer_type!r} is not valid here; choose one of: "
                          f"{', '.join(TOKENIZER_TYPES)} (a SentencePiece or tiktoken model converts to a transformers "
                          "tokenizer folder, which HuggingFaceTokenizer reads)")
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not value or not os.path.isfile(value):
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (a file), got {value!r}")
        return GPT2TokenizerFast(vocab_file=vocab_file, merges_file=merge_file)
    if not name_or_path:
        raise ConfigError("preprocess needs a tokenizer: --tokenizer <folder or hub name> (or Megatron's "
                          "--tokenizer-model)")
    with loading_from(name_or_path, "tokenizer"):
        return AutoTokenizer.from_pretrained(name_or_path)
