"""Instruction pairs for causal language models: a prompt and the response the model learns to write after it. Only
the response's tokens are scored (the prompt's labels are -100), as trl's ``SFTTrainer`` trains on completions.

The pairs on every machine come from the running interpreter's standard library: each documented function
(:mod:`~mindformers_py.data.stdlib.code_summaries`: split by file, the corpus's own train / validation split) gives the
prompt "write the Python function for this docstring" with its docstring's summary line, and the function's source
as the response.
"""

from __future__ import annotations

from typing import Any

import datasets

from ...errors import ConfigError
from .code_summaries import stdlib_docstring_dataset

PROMPT_TEMPLATE = "# Write the Python function for this docstring:\n# {summary}\n"
"""The prompt of a standard-library pair; written as Python comments, which a model pretrained on code reads as
such."""


def docstring_instructions(split: str = "train", max_files: int | None = None) -> datasets.Dataset:
    """``prompt`` / ``response`` pairs of the documented functions of the stdlib files of ``split``: the prompt asks
    for the function of a docstring summary (:data:`PROMPT_TEMPLATE`), the response is the function's source
    (its docstring removed)."""
    rows = stdlib_docstring_dataset(split, max_files)
    return datasets.Dataset.from_dict({"prompt": [PROMPT_TEMPLATE.format(summary=s) for s in rows["summary"]],
                                       "response": list(rows["source"])})


def tokenize_instructions(pairs: datasets.Dataset, tokenizer: Any, block_size: int, prompt_column: str = "prompt",
                          response_column: str = "response") -> datasets.Dataset:
    """``input_ids`` / ``attention_mask`` / ``labels`` rows: the prompt's tokens then the response's and the eos
    token, cut to ``block_size``; the prompt's labels are -100. Rows whose prompt leaves no room for a response
    token are dropped."""
    for column in (prompt_column, response_column):
        if column not in pairs.column_names:
            raise ConfigError(f"column {column!r} is not in the instruction data; columns: {', '.join(pairs.column_names)}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        # verbose=False: a response longer than the tokenizer's model_max_length is expected, it is cut to
        # block_size below (transformers would warn about it once per process)
        prompts = tokenizer(batch[prompt_column], add_special_tokens=False, verbose=False)["input_ids"]
        responses = tokenizer(batch[response_column], add_special_tokens=False, verbose=False)["input_ids"]
        out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for prompt, response in zip(prompts, responses):
            if len(prompt) >= block_size:
                continue
            ids = (prompt + response + eos)[:block_size]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append([-100] * len(prompt) + ids[len(prompt):])
        return out

    return pairs.map(encode, batched=True, remove_columns=pairs.column_names)
