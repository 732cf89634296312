"""Data: the embedded default corpus (Python stdlib source), tokenizer training (BPE, WordPiece), packing, masked-LM
blocks and per-sample masking, collators, the stdlib docstring classification task."""

from mindformers_py.data.cache import default_cache_dir
from mindformers_py.data.collators import DataCollatorForCausalLM, StackingCausalLMCollator
from mindformers_py.data.corpus import load_text_files, split_of, stdlib_corpus, stdlib_files, stdlib_root
from mindformers_py.data.packing import count_tokens, pack_dataset
from mindformers_py.data.pretraining import default_pretraining_data, tokenizer_fingerprint
from mindformers_py.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    ENDOFTEXT,
    PAD,
    default_tokenizer,
    default_tokenizer_path,
    default_wordpiece_tokenizer,
    train_bpe_tokenizer,
    train_wordpiece_tokenizer,
)
from mindformers_py.data.masking import DataCollatorForMaskedLM
from mindformers_py.data.masked_lm import default_masked_lm_data, masked_lm_blocks
from mindformers_py.data.docstrings import stdlib_docstrings

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "DataCollatorForCausalLM",
    "StackingCausalLMCollator",
    "ENDOFTEXT",
    "PAD",
    "count_tokens",
    "default_cache_dir",
    "default_pretraining_data",
    "default_tokenizer",
    "default_tokenizer_path",
    "load_text_files",
    "pack_dataset",
    "split_of",
    "stdlib_corpus",
    "stdlib_files",
    "stdlib_root",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
    "DataCollatorForMaskedLM",
    "default_masked_lm_data",
    "default_wordpiece_tokenizer",
    "masked_lm_blocks",
    "stdlib_docstrings",
    "train_wordpiece_tokenizer",
]
