"""Tokenizers trained locally with the ``tokenizers`` library: byte-level BPE (GPT-2's recipe) and WordPiece (BERT's).

A byte-level BPE needs no download, never produces an unknown token and decodes every string back
exactly, which suits source code. The result is a :class:`transformers.PreTrainedTokenizerFast`, saved
with ``save_pretrained`` so ``transformers.AutoTokenizer.from_pretrained(folder)`` loads it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mindformers_py.data.cache import atomic_dir, fingerprint, resolve_cache_dir
from mindformers_py.data.corpus import stdlib_corpus, stdlib_files, stdlib_root
from mindformers_py.errors import ConfigError

ENDOFTEXT = "<|endoftext|>"
"""GPT-2's document separator; our bos, eos and unk token."""

PAD = "<|pad|>"
"""Padding token. Distinct from eos so padding masks never hide real end-of-text tokens."""

DEFAULT_VOCAB_SIZE = 8192
"""Vocabulary size of :func:`default_tokenizer` (trains in ~20 s on the full stdlib on 2 cores)."""

_CACHE_FORMAT = 1  # bump when the training recipe changes so old cache entries are not reused
_WORDPIECE_FORMAT = 1  # the same, for default_wordpiece_tokenizer


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    save_dir: str | os.PathLike[str] | None = None,
    eos_token: str = ENDOFTEXT,
    pad_token: str = PAD,
    extra_special_tokens: Sequence[str] = (),
    min_frequency: int = 2,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE tokenizer on ``texts``.

    Args:
        texts: training documents (any iterable of strings; read once).
        vocab_size: final vocabulary size, special tokens and the 256 byte symbols included.
        save_dir: when given, the tokenizer is written there with ``save_pretrained``.
        eos_token: end-of-text token, also used as bos and unk (as GPT-2).
        pad_token: padding token (id 1 with the defaults; eos is id 0).
        extra_special_tokens: further special tokens, added after eos and pad.
        min_frequency: a pair must occur at least this often to be merged.
        model_max_length: recorded in the tokenizer config (e.g. the model's context length);
            ``None`` leaves it unlimited.

    Returns:
        The trained :class:`transformers.PreTrainedTokenizerFast`.

    Raises:
        ConfigError: ``vocab_size`` is too small to hold the byte alphabet and special tokens.
    """
    special = list(dict.fromkeys([eos_token, pad_token, *extra_special_tokens]))
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(special)
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ConfigError(
            f"vocab_size={vocab_size!r} is not valid; a byte-level BPE needs at least {minimum} "
            f"(256 bytes + {len(special)} special tokens)"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=eos_token,
        eos_token=eos_token,
        unk_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in special if t not in (eos_token, pad_token)],
        # Decoding must give back the exact text; the English-text space clean-up would alter code.
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def default_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int | None = None,
    validation_fraction: float = 0.05,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the stdlib train split, cached on disk.

    The cache entry ``<cache_dir>/tokenizer-<fingerprint>`` is keyed by the Python version, the
    vocabulary size, the training file list (relative paths and sizes), the ``tokenizers`` version and
    the recipe, so the first call trains (seconds) and later calls only load it (milliseconds).

    Args:
        cache_dir: cache folder; :func:`~mindformers_py.data.cache.default_cache_dir` when None.
        vocab_size: vocabulary size.
        max_files: train on at most this many stdlib files (a fixed sample); None uses all.
        validation_fraction: as in :func:`~mindformers_py.data.corpus.stdlib_corpus`; the
            validation files are never seen by the tokenizer.
    """
    folder = default_tokenizer_path(cache_dir, vocab_size, max_files, validation_fraction)
    if not (folder / "tokenizer.json").is_file():
        texts = stdlib_corpus("train", max_files, validation_fraction)["text"]
        with atomic_dir(folder) as tmp:
            train_bpe_tokenizer(texts, vocab_size, save_dir=tmp)
    return PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))


def default_tokenizer_path(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int | None = None,
    validation_fraction: float = 0.05,
) -> Path:
    """The cache folder :func:`default_tokenizer` uses for these arguments (it may not exist yet)."""
    root = stdlib_root()
    files = [
        (path.relative_to(root).as_posix(), path.stat().st_size)
        for path in stdlib_files("train", max_files, validation_fraction)
    ]
    key = fingerprint(
        _CACHE_FORMAT, platform.python_implementation(), platform.python_version(), tokenizers.__version__,
        vocab_size, ENDOFTEXT, PAD, files,
    )
    return resolve_cache_dir(cache_dir) / f"tokenizer-{key}"


WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""BERT's special tokens, ids 0-4 of a tokenizer from :func:`train_wordpiece_tokenizer`."""


def train_wordpiece_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    save_dir: str | os.PathLike[str] | None = None,
    lowercase: bool = False,
    min_frequency: int = 2,
    model_max_length: int | None = 512,
) -> PreTrainedTokenizerFast:
    """Train a BERT-style WordPiece tokenizer (``[CLS] A [SEP] B [SEP]`` with segment ids, a ``[MASK]`` token) on
    ``texts``.

    Args:
        texts: training documents (any iterable of strings; read once).
        vocab_size: final vocabulary size, special tokens included.
        save_dir: when given, the tokenizer is written there with ``save_pretrained``.
        lowercase: lowercase and strip accents before splitting (BERT-uncased); False keeps the case (code).
        min_frequency: a pair must occur at least this often to be merged.
        model_max_length: recorded in the tokenizer config (the model's longest input).

    Raises:
        ConfigError: ``vocab_size`` is too small for the special tokens and a character alphabet.
    """
    if not isinstance(vocab_size, int) or vocab_size < 128:
        raise ConfigError(f"vocab_size={vocab_size!r} is not valid; a WordPiece tokenizer needs at least 128 "
                          "(special tokens and the characters of the text)")
    from tokenizers import normalizers

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase,
                                                    clean_text=True, handle_chinese_chars=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=list(WORDPIECE_SPECIALS), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                                        pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"], **kwargs)
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def default_wordpiece_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int | None = None,
    validation_fraction: float = 0.05,
) -> PreTrainedTokenizerFast:
    """A cased WordPiece tokenizer trained on the stdlib train split, cached on disk like :func:`default_tokenizer`
    (the first call trains, later calls load)."""
    root = stdlib_root()
    files = [(path.relative_to(root).as_posix(), path.stat().st_size)
             for path in stdlib_files("train", max_files, validation_fraction)]
    key = fingerprint(_WORDPIECE_FORMAT, "wordpiece", platform.python_implementation(), platform.python_version(),
                      tokenizers.__version__, vocab_size, WORDPIECE_SPECIALS, files)
    folder = resolve_cache_dir(cache_dir) / f"tokenizer-wordpiece-{key}"
    if not (folder / "tokenizer.json").is_file():
        texts = stdlib_corpus("train", max_files, validation_fraction)["text"]
        with atomic_dir(folder) as tmp:
            train_wordpiece_tokenizer(texts, vocab_size, save_dir=tmp)
    return PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))
