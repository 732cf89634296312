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
import numpy as np
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
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
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
        reset_position_ids: the blocks also get ``position_ids`` restarting after every separator (Megatron's
            option of this name, :class:`~mindformers_py.data.megatron.gpt_dataset.GPTSampleOptions`); without
            ``reset_attention_mask`` also an ``attention_mask`` of ones, so attention still crosses documents.
        reset_attention_mask: with ``reset_position_ids``: tokens attend only within their document.
        eod_mask_loss: no target is scored after a separator.

    Returns:
        A dataset with int64 columns ``input_ids`` and ``labels`` (equal to ``input_ids``, -100 after a separator
        with ``eod_mask_loss``; the model shifts them), each row of length ``block_size``, in document order; and
        ``position_ids`` (and ``attention_mask``) as the options say.

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
    from .megatron.gpt_dataset import GPTSampleOptions

    separator = tokenizer.eos_token_id if separator_id is None else separator_id
    options = GPTSampleOptions(block_size, eod_token_id=separator, reset_position_ids=reset_position_ids,
                               reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss)
    block = datasets.List(datasets.Value("int64"), length=block_size)
    columns = ["input_ids", "labels"] + (["position_ids"] if reset_position_ids else []) \
        + (["attention_mask"] if reset_position_ids and not reset_attention_mask else [])
    packed = tokenized.with_format("arrow").map(
        _chunk,
        batched=True,
        batch_size=docs_per_group,
        num_proc=None if docs_per_group is None else num_proc,
        fn_kwargs={"block_size": block_size, "options": options},
        features=datasets.Features(dict.fromkeys(columns, block)),
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


def _chunk(batch: pa.Table, block_size: int, options: Any = None) -> pa.Table:
    stream = pc.list_flatten(batch.column("input_ids")).combine_chunks()
    usable = len(stream) // block_size * block_size
    blocks = pa.FixedSizeListArray.from_arrays(stream.slice(0, usable).cast(pa.int64()), block_size)
    if options is None or not (options.reset_position_ids or options.eod_mask_loss):
        return pa.table({"input_ids": blocks, "labels": blocks})
    ids = stream.slice(0, usable).to_numpy(zero_copy_only=False).reshape(-1, block_size)
    after_eod = np.zeros(ids.shape, dtype=bool)
    after_eod[:, 1:] = ids[:, :-1] == options.eod_token_id

    def column(values: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.int64()), block_size)

    out = {"input_ids": blocks, "labels": column(np.where(after_eod, -100, ids) if options.eod_mask_loss else ids)}
    if options.reset_position_ids:
        index = np.broadcast_to(np.arange(block_size), ids.shape)
        out["position_ids"] = column(index - np.maximum.accumulate(np.where(after_eod, index, 0), axis=1))
        if not options.reset_attention_mask:
            out["attention_mask"] = column(np.ones_like(ids))
    return pa.table(out)
