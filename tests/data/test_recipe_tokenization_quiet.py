"""Recipe data that cuts or packs its own sequences tokenizes without transformers' "Token indices sequence length
is longer than the specified maximum sequence length" warning: a tokenizer whose ``model_max_length`` is shorter
than a document (an HF checkpoint's 512) would otherwise print it from every process of a run."""

from __future__ import annotations

import logging

import datasets
import pytest

from mindformers_py.data import pack_dataset, train_bpe_tokenizer
from mindformers_py.data.stdlib.instructions import tokenize_instructions

LONG = "def f(x):\n    return x + 1\n" * 40  # far longer than the tokenizer's 16-token model_max_length


@pytest.fixture
def short_tokenizer():  # a fresh one per test: transformers warns once per tokenizer
    return train_bpe_tokenizer([LONG, "def g(y): pass\n"] * 4, vocab_size=300, model_max_length=16)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log():
    # transformers' loggers do not propagate to the root logger (caplog), so listen on its own
    handler = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def test_instruction_pairs_cut_to_block_size_without_the_length_warning(short_tokenizer, transformers_log):
    pairs = datasets.Dataset.from_dict({"prompt": ["# Write f:\n"] * 3, "response": [LONG] * 3})
    rows = tokenize_instructions(pairs, short_tokenizer, block_size=12)
    assert len(rows) == 3 and all(len(ids) == 12 for ids in rows["input_ids"])  # cut by us, as documented
    assert not [m for m in transformers_log if "Token indices sequence length" in m]


def test_packed_text_without_the_length_warning(short_tokenizer, transformers_log):
    blocks = pack_dataset(datasets.Dataset.from_dict({"text": [LONG] * 2}), short_tokenizer, 8)
    assert len(blocks) > 2
    assert not [m for m in transformers_log if "Token indices sequence length" in m]
