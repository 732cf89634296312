"""Tokenizers with T5's conventions, trained locally: byte-level BPE (no unknown token, exact round trip of
source code) with T5's special tokens and sentinels.

* ids 0, 1, 2 are ``<pad>`` (also the decoder start token), ``</s>`` (appended to every encoded text, as T5's
  SentencePiece model does) and ``<unk>`` (never produced by a byte-level model; kept for T5 compatibility);
* the last ``extra_ids`` ids are the sentinels of span corruption, ``<extra_id_0>`` being the very last id (T5's
  layout), all special tokens, so ``decode(..., skip_special_tokens=True)`` drops them.

The result is a :class:`transformers.PreTrainedTokenizerFast` saved with ``save_pretrained``; ``AutoTokenizer``
loads it back. :func:`default_t5_tokenizer` trains one on the stdlib corpus once and caches it, like
:func:`~mindformers_py.data.tokenizers.bpe_wordpiece.default_tokenizer` does for GPT.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mindformers_py.data.cache import atomic_dir, fingerprint, resolve_cache_dir
from mindformers_py.data.corpus import stdlib_corpus, stdlib_files, stdlib_root
from mindformers_py.errors import ConfigError

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
"""T5's special tokens, at ids 0, 1 and 2."""
DEFAULT_EXTRA_IDS = 100
"""Sentinel tokens of a T5 vocabulary (``<extra_id_0>`` ... ``<extra_id_99>``)."""
_CACHE_FORMAT = 1  # bump when the training recipe changes so old cache entries are not reused


def sentinel(i: int) -> str:
    """The text of sentinel ``i`` (``<extra_id_i>``)."""
    return f"<extra_id_{i}>"


def sentinel_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids of the tokenizer's sentinels in order (``<extra_id_0>`` first); empty when it has none."""
    vocab = tokenizer.get_vocab()
    ids, i = [], 0
    while sentinel(i) in vocab:
        ids.append(vocab[sentinel(i)])
        i += 1
    return ids


def train_t5_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    extra_ids: int = DEFAULT_EXTRA_IDS,
    save_dir: str | os.PathLike[str] | None = None,
    min_frequency: int = 2,
    model_max_length: int = 512,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with T5's special tokens and ``extra_ids`` sentinels on ``texts``.

    Args:
        texts: training documents (read once).
        vocab_size: final vocabulary size: 3 special tokens, the 256 byte symbols, merges and the sentinels.
        extra_ids: sentinel tokens, at the end of the vocabulary (``<extra_id_0>`` last).
        save_dir: when given, the tokenizer is written there with ``save_pretrained``.
        min_frequency: a pair must occur at least this often to be merged.
        model_max_length: recorded in the tokenizer config (T5's 512).
    """
    minimum = 3 + len(pre_tokenizers.ByteLevel.alphabet()) + extra_ids
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ConfigError(f"vocab_size={vocab_size!r} is not valid; a byte-level T5 tokenizer needs at least {minimum} "
                          f"(3 special tokens + 256 bytes + {extra_ids} sentinels)")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - extra_ids, min_frequency=min_frequency,
                                  special_tokens=[PAD, EOS, UNK], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    # Sentinels take the ids after the learned ones, in reverse, so <extra_id_0> is the last id (as in T5).
    backend.add_special_tokens([sentinel(i) for i in reversed(range(extra_ids))])
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                      special_tokens=[(EOS, backend.token_to_id(EOS))]),
    ])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[sentinel(i) for i in range(extra_ids)],
        # Decoding must give back the exact text; the English-text space clean-up would alter code.
        clean_up_tokenization_spaces=False, model_max_length=model_max_length,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def default_t5_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = 8192,
    max_files: int | None = None,
    extra_ids: int = DEFAULT_EXTRA_IDS,
    validation_fraction: float = 0.05,
) -> PreTrainedTokenizerFast:
    """A T5-style tokenizer trained on the stdlib train split, cached on disk (keyed by the Python version, the
    sizes, the training file list and the ``tokenizers`` version): the first call trains, later ones load."""
    root = stdlib_root()
    files = [(p.relative_to(root).as_posix(), p.stat().st_size)
             for p in stdlib_files("train", max_files, validation_fraction)]
    key = fingerprint(_CACHE_FORMAT, "t5", platform.python_implementation(), platform.python_version(),
                      tokenizers.__version__, vocab_size, extra_ids, files)
    folder = Path(resolve_cache_dir(cache_dir)) / f"t5-tokenizer-{key}"
    if not (folder / "tokenizer.json").is_file():
        texts = stdlib_corpus("train", max_files, validation_fraction)["text"]
        with atomic_dir(folder) as tmp:
            train_t5_tokenizer(texts, vocab_size, extra_ids, save_dir=tmp)
    return PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))
