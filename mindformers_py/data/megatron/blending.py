"""Weighted mixtures of datasets: Megatron's blended datasets over indexed corpora, and the same blending for
``datasets`` tables.

Megatron-Core's rule (``build_blending_indices``): sample ``n`` of the mixture comes from the source whose count
lags its share most, ``argmax_i(weight_i * max(n, 1) - taken_i)``, so every prefix of the mixture holds each source
in proportion to its weight (to within a sample), deterministically. For weighted indexed corpora each source is
built with ``ceil(ceil(size * weight) * 1.005)`` samples (Megatron's ``mid_level_dataset_surplus``), repeating
epochs of it as needed, and the mixture has ``sum(ceil(size * weight))`` samples, exactly as
``BlendedMegatronDatasetBuilder`` makes them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from .indexed_dataset import IndexedDataset
from .gpt_dataset import SPLITS, GPTSampleOptions, MegatronGPTDataset, parse_split, split_indices

SURPLUS = 0.005
"""Extra samples built per source of a weighted blend (Megatron's ``mid_level_dataset_surplus``)."""


def parse_data_path(data_path: Sequence[Any] | str) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``[prefix]``, ``[prefix, prefix, ...]`` (weighted by their sizes) or
    ``[weight, prefix, weight, prefix, ...]``; returns the prefixes and the normalised weights (or None)."""
    items = [data_path] if isinstance(data_path, (str, os.PathLike)) else list(data_path)
    if not items:
        raise ConfigError("data.data_path is empty; give [prefix] or [weight, prefix, weight, prefix, ...]")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except (TypeError, ValueError):
            weights = None
        if weights is not None:
            prefixes = [str(p).strip() for p in items[1::2]]
            if any(w <= 0 or not math.isfinite(w) for w in weights):
                raise ConfigError(f"data.data_path weights must be positive numbers, got {weights}")
            return prefixes, normalize(weights)
    return [str(p).strip() for p in items], None


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum (in float64, as Megatron)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source of each sample (int16), its index within that source (int64))`` for a mixture of ``size`` samples
    in proportion to the normalised ``weights`` (Megatron's ``build_blending_indices``)."""
    source = np.zeros(size, dtype=np.int16)
    within = np.zeros(size, dtype=np.int64)
    taken = [0] * len(weights)
    w = [float(x) for x in weights]
    for n in range(size):
        scale = max(float(n), 1.0)
        best, best_error = 0, w[0] * scale - taken[0]
        for i in range(1, len(w)):
            error = w[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        source[n], within[n] = best, taken[best]
        taken[best] += 1
    return source, within


def exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The mixture taking every sample of every source exactly once, interleaved in proportion to the sizes
    (Megatron's ``build_exhaustive_blending_indices``)."""
    total = int(sum(sizes))
    weights = [s / total for s in sizes]
    source = np.zeros(total, dtype=np.int16)
    within = np.zeros(total, dtype=np.int64)
    taken = [0] * len(sizes)
    unspent = [i for i, s in enumerate(sizes) if s > 0]
    for n in range(total):
        scale = max(float(n), 1.0)
        best, best_error = -1, -math.inf
        for i in unspent:
            error = weights[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        source[n], within[n] = best, taken[best]
        taken[best] += 1
        if taken[best] == sizes[best]:
            unspent.remove(best)
    return source, within


class BlendedDataset(torch.utils.data.Dataset):
    """A mixture of map-style datasets: sample ``n`` is ``datasets[source[n]][within[n]]``.

    Args:
        datasets: the sources.
        weights: their shares (normalised here); None: every sample of every source once, in proportion to their
            sizes.
        size: samples of the mixture (needed with ``weights``).
    """

    shuffled = True
    """The sources' own order is kept (Megatron's samples are shuffled already): the Trainer reads in order."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float] | None, size: int | None) -> None:
        self.datasets = list(datasets)
        if weights is None:
            self.source, self.within = exhaustive_blending_indices([len(d) for d in self.datasets])
        else:
            if size is None:
                raise ConfigError("a weighted blend needs its number of samples")
            self.source, self.within = blending_indices(normalize(weights), size)
        for i, dataset in enumerate(self.datasets):
            needed = int((self.source == i).sum())
            if needed > len(dataset):
                raise ConfigError(f"the blend takes {needed} samples from source {i}, which has {len(dataset)}")

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, n: int) -> Any:
        return self.datasets[int(self.source[n])][int(self.within[n])]


def build_megatron_datasets(data_path: Sequence[Any] | str, split: str, sizes: Sequence[int | None],
                            options: GPTSampleOptions, splits: Sequence[str] = SPLITS,
                            cache_dir: str | os.PathLike[str] | None = None) -> list[Any]:
    """The train / validation / test datasets of Megatron's ``--data-path`` and ``--split`` (the datasets
    ``BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...)`` builds), for the names in ``splits`` (None for the
    others and for empty splits).

    Args:
        data_path: prefixes, optionally weighted (:func:`parse_data_path`).
        split: e.g. ``"969,30,1"``.
        sizes: samples of each split (None: one epoch; a weighted blend then takes the sum of its sources' epochs).
        options: how samples are cut.
        splits: which splits to build.
        cache_dir: where the indices are cached (default: beside the data).
    """
    prefixes, weights = parse_data_path(data_path)
    bookends = parse_split(split)
    indexed = [IndexedDataset(p) for p in prefixes]
    out: list[Any] = []
    for s, name in enumerate(SPLITS):
        if name not in splits or bookends[s] is None:
            out.append(None)
            continue

        def source(dataset: IndexedDataset, num_samples: int | None) -> MegatronGPTDataset:
            return MegatronGPTDataset(dataset, split_indices(len(dataset), bookends[s]), num_samples, name, options,
                                      cache_dir)

        size = sizes[s]
        if len(prefixes) == 1 and weights is None:
            out.append(source(indexed[0], size))
            continue
        if weights is None:
            parts = [source(d, None) for d in indexed]
            lengths = [len(p) for p in parts]
            blend_size = None if size is None else min(size, sum(lengths))
            out.append(BlendedDataset(parts, lengths if blend_size is not None else None, blend_size))
            continue
        if size is None:  # one epoch of every source, mixed by the weights
            size = sum(len(source(d, None)) for d in indexed)
        targets = [math.ceil(size * w) for w in weights]
        parts = [source(d, math.ceil(t * (1 + SURPLUS))) for d, t in zip(indexed, targets)]
        out.append(BlendedDataset(parts, weights, sum(targets)))
    return out


def mix_datasets(parts: Sequence[Any], weights: Sequence[float], size: int | None = None) -> Any:
    """A weighted mixture of ``datasets.Dataset`` tables (rows of the same columns), blended by Megatron's rule:
    ``size`` rows (default: all rows of all parts), each part contributing its share, its rows taken in order and
    repeated when the share exceeds them."""
    import datasets

    if len(parts) != len(weights):
        raise ConfigError(f"data.train_weights has {len(weights)} weights for {len(parts)} data sources; give one "
                          "weight per data.train_files entry")
    if any(w <= 0 for w in weights):
        raise ConfigError(f"data.train_weights must be positive, got {list(weights)}")
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(f"data source {empty[0]} (data.train_files entry {empty[0]}) has no rows to mix")
    size = sum(len(p) for p in parts) if size is None else size
    source, within = blending_indices(normalize(weights), size)
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
    lengths = np.asarray([len(p) for p in parts])
    rows = offsets[source] + within % lengths[source]
    return datasets.concatenate_datasets(list(parts)).select(rows.tolist())
