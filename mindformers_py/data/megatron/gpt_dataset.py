"""GPT training samples from Megatron indexed datasets, as Megatron-Core's ``GPTDataset`` draws them.

A split of an indexed dataset (a range of its sequences) is read through three indices, built once and cached beside
the data (``<data folder>/cache/GPTDataset_indices/``, keyed by a digest of everything that decides them):

* the **document index**: the split's sequence ids repeated for as many epochs as the requested number of samples
  needs, shuffled by ``numpy.random.RandomState(seed)`` (the last epoch shuffled on its own when it is used for less
  than 80% of its samples, as Megatron does);
* the **sample index**: where each sample starts in the concatenation of the documents in that order (a document
  position and an offset); samples are ``sequence_length + 1`` tokens that overlap by one (the inputs and their
  next-token targets), the last incomplete one dropped;
* the **shuffle index**: a permutation of the samples by the same random state.

So sample ``i`` is exactly Megatron's sample ``i`` for the same files, seed, split and sizes (tested against
megatron-core). Each sample holds ``input_ids`` (the first ``sequence_length`` tokens), ``shift_labels`` (the
next-token targets, -100 where Megatron's loss mask is 0), ``labels`` (the same targets in transformers' unshifted
convention, for counting) and, with ``reset_position_ids`` / ``reset_attention_mask``, the document boundaries as
metadata: ``position_ids`` restarting after each end-of-document token. Documents then attend only to themselves
(:mod:`~mindformers_py.layers.document_mask`); no (S, S) mask is ever built.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from ...layers.loss import IGNORE_INDEX
from ..cache import fingerprint, resolve_cache_dir
from .indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
_FORMAT = 1  # bump when the indices change, so old cache entries are not reused
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's


@dataclass(frozen=True)
class GPTSampleOptions:
    """How samples are cut and what they carry (Megatron's ``GPTDatasetConfig`` fields of the same names)."""

    sequence_length: int
    """Tokens per sample (Megatron's ``--seq-length``)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (Megatron's ``--seed``)."""
    eod_token_id: int | None = None
    """The end-of-document token (the tokenizer's eos); needed by the three options below."""
    reset_position_ids: bool = False
    """Positions restart at 0 after every end-of-document token."""
    reset_attention_mask: bool = False
    """Tokens attend only to the tokens of their own document."""
    eod_mask_loss: bool = False
    """No loss on the prediction made at an end-of-document token (of the next document's first token)."""
    pad_token_id: int | None = None
    """Targets equal to this id are not scored (Megatron's pad masking; None, or the eod id, masks nothing)."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_length, int) or self.sequence_length < 2:
            raise ConfigError(f"data.block_size={self.sequence_length!r} must be an integer >= 2")
        needs_eod = [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, n)]
        if needs_eod and self.eod_token_id is None:
            raise ConfigError(f"data.{needs_eod[0]}=true needs the tokenizer's end-of-document (eos) token; the "
                              "tokenizer has none")
        if self.reset_attention_mask and not self.reset_position_ids:
            raise ConfigError("data.reset_attention_mask=true with data.reset_position_ids=false is not supported: "
                              "document boundaries reach attention as restarting position ids; set "
                              "data.reset_position_ids: true too")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """Megatron's ``--split`` (``"969,30,1"``: train, validation, test weights) as the bookends of each split in
    [0, 1] (None for an empty one): ``parse_and_normalize_split`` + ``convert_split_vector_to_split_matrix``."""
    import re

    try:
        weights = [float(x) for x in re.findall(r"[.0-9]+", str(split))]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r} is not valid; give up to three non-negative weights for train, "
                          "validation and test, e.g. '969,30,1'")
    weights = weights + [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds, start = [], 0.0
    for w in weights:
        end = start + w / total
        bounds.append(None if end <= start else (start, end))
        start = end
    return bounds


def split_indices(num_sequences: int, bookends: tuple[float, float]) -> np.ndarray:
    """The sequence ids of one split (int32), rounded as Megatron rounds them."""
    begin, end = (int(round(b * float(num_sequences))) for b in bookends)
    return np.arange(begin, end, dtype=np.int32)


class MegatronGPTDataset(torch.utils.data.Dataset):
    """Samples of one split of an indexed dataset (see the module docstring).

    Args:
        indexed: the memory-mapped dataset.
        indices: the split's sequence ids (:func:`split_indices`).
        num_samples: samples to build (several epochs when the split holds fewer); None: one epoch.
        split: the split's name (``train``, ``valid``, ``test``), part of the cache key.
        options: sample options.
        cache_dir: where the indices are cached; None: ``<data folder>/cache/GPTDataset_indices`` (or the package's
            cache when the data folder is read-only).
    """

    shuffled = True
    """The samples are in their training order already: the Trainer reads them in order (Megatron's sequential
    sampler over ``consumed_samples``) rather than shuffling them again."""

    def __init__(self, indexed: IndexedDataset, indices: np.ndarray, num_samples: int | None, split: str,
                 options: GPTSampleOptions, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.indexed = indexed
        self.indices = indices
        self.num_samples = num_samples
        self.split = split
        self.options = options
        if len(indices) == 0 or int(indexed.sequence_lengths[indices].sum(dtype=np.int64)) <= options.sequence_length:
            raise ConfigError(f"the {split} split of {indexed.prefix} holds too few tokens for one sample of "
                              f"{options.sequence_length} + 1 tokens; change data.split or data.block_size")
        stamp = os.stat(f"{indexed.prefix}.idx").st_mtime_ns  # rewritten data never meets old indices
        key = fingerprint(_FORMAT, os.path.abspath(indexed.prefix), stamp, indexed.num_tokens, len(indexed), split,
                          int(indices[0]), len(indices), num_samples, options.sequence_length, options.seed)
        self.document_index, self.sample_index, self.shuffle_index = _cached_indices(
            _cache_folder(indexed.prefix, cache_dir), key, lambda: build_gpt_indices(
                indexed.sequence_lengths, indices, num_samples, options.sequence_length, options.seed))

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def tokens(self, idx: int) -> np.ndarray:
        """The ``sequence_length + 1`` tokens of sample ``idx`` (int64)."""
        i = int(self.shuffle_index[idx])
        (doc_beg, offset_beg), (doc_end, offset_end) = self.sample_index[i], self.sample_index[i + 1]
        if doc_beg == doc_end:
            return self.indexed.get(int(self.document_index[doc_beg]), int(offset_beg),
                                    int(offset_end - offset_beg) + 1).astype(np.int64)
        parts = [self.indexed.get(int(self.document_index[doc_beg]), int(offset_beg))]
        parts += [self.indexed.get(int(self.document_index[d])) for d in range(doc_beg + 1, doc_end)]
        parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, int(offset_end) + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return gpt_sample(torch.from_numpy(self.tokens(idx)), self.options)


def gpt_sample(text: torch.Tensor, options: GPTSampleOptions) -> dict[str, torch.Tensor]:
    """A sample's tensors from its ``sequence_length + 1`` tokens: Megatron's ``_get_ltor_masks_and_position_ids``
    with the loss mask folded into the targets and the attention mask kept as restarting positions."""
    tokens, targets = text[:-1].clone(), text[1:].clone()
    loss_mask = torch.ones(tokens.shape, dtype=torch.bool)
    eod = options.eod_token_id
    if options.eod_mask_loss:
        loss_mask &= tokens != eod
    pad = options.pad_token_id
    if pad is not None and pad != eod:
        loss_mask &= targets != pad
    shift_labels = targets.masked_fill(~loss_mask, IGNORE_INDEX)
    sample = {"input_ids": tokens, "labels": torch.cat([torch.tensor([IGNORE_INDEX]), shift_labels[:-1]]),
              "shift_labels": shift_labels}
    if options.reset_position_ids:
        sample["position_ids"] = document_positions(tokens, eod)
        if not options.reset_attention_mask:  # restarting positions alone would also cut attention at documents
            sample["attention_mask"] = torch.ones_like(tokens)
    return sample


def document_positions(tokens: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """Positions (int64) that restart at 0 after every ``eod_token_id`` of a row (the eod belongs to the document it
    ends), Megatron's ``reset_position_ids``."""
    index = torch.arange(tokens.shape[-1])
    after_eod = torch.zeros_like(tokens, dtype=torch.bool)
    after_eod[..., 1:] = tokens[..., :-1] == eod_token_id
    starts = torch.where(after_eod, index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=-1).values


# -- the three indices -----------------------------------------------------------------------------------------------


def build_gpt_indices(sequence_lengths: np.ndarray, indices: np.ndarray, num_samples: int | None,
                      sequence_length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(document_index, sample_index, shuffle_index)`` exactly as Megatron-Core's ``GPTDataset`` builds them
    (``_build_document_sample_shuffle_indices``, its C++ ``build_sample_idx`` vectorised with numpy)."""
    tokens_per_epoch = int(sequence_lengths[indices].sum(dtype=np.int64))
    num_epochs = 1
    if num_samples is not None:
        while num_epochs * tokens_per_epoch < num_samples * sequence_length + 1:
            num_epochs += 1
    separate_final_epoch = False
    if num_epochs > 1:
        without_final = ((num_epochs - 1) * tokens_per_epoch - 1) // sequence_length
        from_final = num_samples - without_final
        per_epoch = (tokens_per_epoch - 1) // sequence_length
        separate_final_epoch = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    state = np.random.RandomState(seed)
    document_index = _document_index(indices, num_epochs, state, separate_final_epoch)
    sample_index = _sample_index(sequence_lengths, document_index, sequence_length, num_epochs * tokens_per_epoch)
    total = len(sample_index) - 1
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    if separate_final_epoch:
        first = np.arange(without_final, dtype=dtype)
        state.shuffle(first)
        last = np.arange(without_final, total, dtype=dtype)
        state.shuffle(last)
        shuffle_index = np.concatenate([first, last])
    else:
        shuffle_index = np.arange(total, dtype=dtype)
        state.shuffle(shuffle_index)
    return document_index, sample_index, shuffle_index


def _document_index(indices: np.ndarray, num_epochs: int, state: np.random.RandomState,
                    separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(indices.astype(np.int32), num_epochs)
        state.shuffle(document_index)
        return document_index
    first = _document_index(indices, num_epochs - 1, state, False)
    return np.concatenate([first, _document_index(indices, 1, state, False)])


def _sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, sequence_length: int,
                  total_tokens: int) -> np.ndarray:
    """Sample ``k`` starts at token ``k * sequence_length`` of the documents concatenated in ``document_index``
    order: the row ``(position in document_index, offset in that document)`` of the document holding that token
    (a document ending exactly there is passed over, as are empty ones; the first row is always (0, 0))."""
    num_samples = (total_tokens - 1) // sequence_length
    ends = np.cumsum(sequence_lengths[document_index], dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    doc = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[doc] - sequence_lengths[document_index][doc])
    big = max(len(document_index), int(sequence_lengths.max())) > np.iinfo(np.int32).max
    sample_index = np.stack([doc, offset], axis=1).astype(np.int64 if big else np.int32)
    sample_index[0] = 0
    return sample_index


def _cache_folder(prefix: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    beside = Path(prefix).resolve().parent / "cache" / "GPTDataset_indices"
    try:
        beside.mkdir(parents=True, exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    return resolve_cache_dir(None) / "GPTDataset_indices"  # a read-only data folder


def _cached_indices(folder: Path, key: str, build: Any) -> tuple[np.ndarray, ...]:
    """The indices saved under ``folder/<key>-*.npy`` (memory-mapped), built and saved first when missing. Each file
    is written under a temporary name and renamed, so processes building the same entry at once are harmless."""
    names = ("document_index", "sample_index", "shuffle_index")
    paths = [folder / f"{key}-{name}.npy" for name in names]
    if not all(p.is_file() for p in paths):
        arrays = build()
        folder.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, arrays):
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, array)
            os.replace(tmp, path)
        (folder / f"{key}-description.json").write_text(json.dumps({"key": key, "samples": len(arrays[1]) - 1}))
        return arrays
    return tuple(np.load(p, mmap_mode="r") for p in paths)
