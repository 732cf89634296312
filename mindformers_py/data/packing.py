"""Packing documents into fixed-length blocks for causal-LM pretraining (GPT-2 / run_clm style).

Each document is tokenised without special tokens and followed by the tokenizer's eos token; the
resulting stream is cut into consecutive blocks of ``block_size`` tokens and the incomplete tail is
dropped. No padding is ever needed and no token is wasted except that tail. Both steps are
``datasets.map(batched=True)`` calls, so a file-backed dataset (e.g. from ``load_text_files``) gets
datasets' result caching for free.
"""

from __future__ import annotations

from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from mindformers_py.errors import ConfigError, MindFormersError


def pack_dataset(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    text_column: str = "text",
    num_proc: int | None = None,
    docs_per_group: int | None = None,
    separator_id: int | None = None,
) -> datasets.Dataset:
    """Tokenise ``dataset[text_column]`` and pack it into blocks of exactly ``block_size`` tokens.

    Args:
        dataset: documents, one per row.
        tokenizer: any HF tokenizer with an eos token.
        block_size: tokens per block (the model's training context length).
        text_column: column holding the text; all columns are replaced by the output columns.
        num_proc: processes for tokenisation (datasets' ``num_proc``); None tokenises in this process.
        docs_per_group: None packs the whole token stream at once (exact: only the final tail is
            dropped; needs ~16 bytes of memory per token). An integer packs each run of that many
            documents separately (bounded memory for huge corpora, parallel with ``num_proc``), dropping
            each run's tail.
        separator_id: the token put after each document; None uses the tokenizer's eos token (BERT-style
            tokenizers have none and pass their ``[SEP]``).

    Returns:
        A dataset with int64 columns ``input_ids`` and ``labels`` (equal to ``input_ids``; the model
        shifts them), each row of length ``block_size``, in document order.

    Raises:
        MindFormersError: the column is missing, the tokenizer has no eos token, or the dataset holds
            fewer than ``block_size`` tokens.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size={block_size!r} is not valid; use a positive integer")
    if text_column not in dataset.column_names:
        raise MindFormersError(
            f"text_column={text_column!r} is not a column of the dataset; columns: {', '.join(dataset.column_names)}"
        )
    if separator_id is None and tokenizer.eos_token_id is None:
        raise MindFormersError(
            f"tokenizer {type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token to separate documents"
        )
    tokenized = dataset.map(
        _tokenize,
        batched=True,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column,
                   "eos_token_id": tokenizer.eos_token_id if separator_id is None else separator_id},
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64"))}),
        desc="Tokenizing",
    )
    total = count_tokens(tokenized)
    if total < block_size:
        raise MindFormersError(
            f"the dataset has {total} tokens (eos included), fewer than block_size={block_size}; "
            "use more text or a smaller block_size"
        )
    block = datasets.List(datasets.Value("int64"), length=block_size)
    packed = tokenized.with_format("arrow").map(
        _chunk,
        batched=True,
        batch_size=docs_per_group,
        num_proc=None if docs_per_group is None else num_proc,
        fn_kwargs={"block_size": block_size},
        features=datasets.Features({"input_ids": block, "labels": block}),
        desc="Packing",
    )
    return packed.with_format(None)


def count_tokens(tokenized: datasets.Dataset, column: str = "input_ids") -> int:
    """Total number of tokens in a column of token-id lists (read from Arrow, without decoding rows)."""
    lengths = pc.list_value_length(tokenized.data.column(column))
    return int(pc.sum(lengths).as_py() or 0)


def _tokenize(
    batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str, eos_token_id: int
) -> dict[str, list[list[int]]]:
    # verbose=False: documents longer than model_max_length are expected here, they are cut into blocks later.
    encoded = tokenizer(batch[text_column], add_special_tokens=False, return_attention_mask=False, verbose=False)
    return {"input_ids": [ids + [eos_token_id] for ids in encoded["input_ids"]]}


def _chunk(batch: pa.Table, block_size: int) -> pa.Table:
    stream = pc.list_flatten(batch.column("input_ids")).combine_chunks()
    usable = len(stream) // block_size * block_size
    blocks = pa.FixedSizeListArray.from_arrays(stream.slice(0, usable).cast(pa.int64()), block_size)
    return pa.table({"input_ids": blocks, "labels": blocks})
