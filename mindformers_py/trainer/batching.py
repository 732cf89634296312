"""Batches for the Trainer: a resumable sampler over global batches (map-style data) or a stream's global batches
(iterable data), and the columns handed to the collator.

Training order is a pure function of (data seed, epoch): every epoch is one permutation cut into consecutive
global micro-batches of ``per_device_train_batch_size x data-parallel size`` samples, each data-parallel rank
reading its part (:meth:`Engine.shard_indices`). So a step sees the same samples whatever the layout and the
gradient-accumulation split, and resuming at (epoch, micro-batches consumed) skips exactly the samples already
used without loading them.

A global batch the data-parallel ranks do not divide (an epoch's last, an evaluation set's size) is split unevenly,
the ranks' shares differing by one sample at most (:meth:`Engine.batch_share`); a rank whose share is empty (a
last batch smaller than the data-parallel size) reads the batch's first sample as padding, which counts for
nothing: every source yields ``(batch, real_rows)``, the rows of ``batch`` that are this rank's samples (the
first ones), so losses, item counts, token counts and gathered predictions leave the padding out, as accelerate's
``gather_for_metrics`` drops its duplicates.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers.trainer_utils import RemoveColumnsCollator

from ..errors import MindFormersError
from ..utils.batch_rows import batch_rows, first_rows


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields one data-parallel rank's sample indices for each global micro-batch of an epoch.

    Args:
        num_samples: length of the dataset.
        global_batch_size: samples of one micro-batch over all data-parallel ranks.
        shard: maps a global batch's indices to this rank's (``Engine.shard_indices``: its share, or the batch's
            first index as padding when its share is empty).
        shuffle: permute the samples every epoch (training) or keep their order (evaluation).
        seed: base of the per-epoch permutation seed.
        drop_last: drop a last global batch smaller than ``global_batch_size``.
        share: ``share(rows) -> (first, count)``, this rank's share of a global batch of ``rows`` samples
            (``Engine.batch_share``), which :meth:`real_rows` reads; None: every index ``shard`` gives is real.
    """

    def __init__(self, num_samples: int, global_batch_size: int, shard: Callable[[Sequence[int]], list[int]],
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 share: Callable[[int], tuple[int, int]] | None = None) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shard = shard
        self.share = share
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Iterate epoch ``epoch`` from its micro-batch ``skip_batches`` on."""
        self.epoch = epoch
        self.skip = skip_batches

    def batches_per_epoch(self) -> int:
        """Global micro-batches in a whole epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def order(self) -> torch.Tensor:
        """The sample order of the current epoch."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order().tolist()
        size = self.global_batch_size
        for b in range(self.skip, self.batches_per_epoch()):
            yield self.shard(order[b * size:(b + 1) * size])

    def real_rows(self) -> Iterator[int]:
        """For each batch :meth:`__iter__` yields, how many of its first rows are this rank's samples (the others
        are padding)."""
        size = self.global_batch_size
        for b in range(self.skip, self.batches_per_epoch()):
            rows = min(size, self.num_samples - b * size)
            yield self.share(rows)[1] if self.share is not None else len(self.shard(range(rows)))

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch() - self.skip)


def build_dataloader(dataset: Dataset, sampler: GlobalBatchSampler, collate_fn: Callable[[list[Any]], Any],
                     num_workers: int, pin_memory: bool, prefetch_factor: int | None, seed: int,
                     persistent: bool = True) -> DataLoader:
    """A DataLoader over ``sampler``'s batches (workers kept across epochs when ``persistent``). It gets its own
    generator, so creating iterators never draws from the global torch RNG (which would shift dropout masks
    between a resumed and an uninterrupted run)."""
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        # Workers hold copies of the dataset: one that follows the epoch (set_epoch) needs fresh copies each epoch.
        kwargs["persistent_workers"] = persistent and not hasattr(dataset, "set_epoch")
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed), **kwargs)


def forward_columns(model: Any, label_names: Sequence[str]) -> list[str]:
    """Batch keys the model's ``forward`` takes by name, plus the label keys (HF's ``remove_unused_columns``) and
    ``shift_labels``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    names = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    # shift_labels: transformers' pre-shifted targets, which causal LMs take through **kwargs (Megatron's samples)
    return list(dict.fromkeys(names + list(label_names) + ["label", "label_ids", "shift_labels"]))


def drop_unused_columns(dataset: Any, collate_fn: Callable, columns: Sequence[str], description: str) -> tuple[Any, Callable]:
    """``(dataset, collate_fn)`` that hand the collator only ``columns``: a ``datasets.Dataset`` loses the other
    columns once, any other dataset's examples are filtered per batch (transformers' ``RemoveColumnsCollator``)."""
    if not columns:
        return dataset, collate_fn
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list) and hasattr(dataset, "remove_columns"):
        unused = [c for c in column_names if c not in columns]
        if unused and len(unused) < len(column_names):
            dataset = dataset.remove_columns(unused)
        return dataset, collate_fn
    return dataset, RemoveColumnsCollator(collate_fn, list(columns), description=description)


class EpochBatches:
    """One data-parallel rank's micro-batches, epoch by epoch, from a map-style dataset: the
    :class:`GlobalBatchSampler` and the DataLoader reading its batches; iterating yields ``(batch, real_rows)``."""

    def __init__(self, sampler: GlobalBatchSampler, loader: DataLoader) -> None:
        self.sampler = sampler
        self.loader = loader
        self.global_batch_size = sampler.global_batch_size

    @property
    def batches_per_epoch(self) -> int | None:
        """Global micro-batches in one epoch."""
        return self.sampler.batches_per_epoch()

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Iterate epoch ``epoch`` from its micro-batch ``skip_batches`` on (without loading the skipped ones); a
        dataset with a ``set_epoch`` (epoch-seeded augmentation) is told the epoch too, as accelerate does."""
        self.sampler.set_epoch(epoch, skip_batches)
        if hasattr(self.loader.dataset, "set_epoch"):
            self.loader.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        return zip(self.loader, self.sampler.real_rows())


@dataclass
class StepBatches:
    """One optimizer step's micro-batches as this rank reads them (see :func:`read_step`)."""

    micro_batches: list[Any]
    """The batches as the engine trains on them (cut by ``Engine.shard_batch``)."""
    real_rows: list[int]
    """How many of each batch's first rows are samples (the rest is a rank's padding row)."""

    @property
    def counted(self) -> list[Any]:
        """The batches cut to their real rows: what items, tokens and the loss mode are counted on."""
        return [first_rows(b, rows) for b, rows in zip(self.micro_batches, self.real_rows)]

    @property
    def padding(self) -> dict[str, Any]:
        """``Engine.forward_backward``'s keyword for the padding rows: ``real_rows`` when a batch has padding, else
        none (an engine registered by a user need not know it)."""
        padded = any(rows < batch_rows(b) for b, rows in zip(self.micro_batches, self.real_rows))
        return {"real_rows": self.real_rows} if padded else {}


def read_step(batches: Iterator[tuple[Any, int]], accum: int, shard: Callable[[Any], Any]) -> StepBatches | None:
    """The next ``accum`` ``(batch, real_rows)`` of a source's iterator, each batch cut by ``shard``; None at its
    end."""
    read = list(itertools.islice(batches, accum))
    if not read:
        return None
    return StepBatches([shard(b) for b, _ in read], [rows for _, rows in read])


class StreamBatches:
    """One data-parallel rank's micro-batches from an iterable dataset (a stream: ``torch.utils.data.IterableDataset``
    or a ``datasets.IterableDataset``), as transformers' Trainer takes with ``max_steps``.

    Every rank reads the stream in order and cuts it into global micro-batches of ``global_batch_size`` samples; each
    rank collates its contiguous share (:meth:`Engine.shard_indices`), so a step sees the same samples whatever the
    layout, as with map-style data; iterating yields ``(batch, real_rows)``, every row real here. An incomplete
    last global batch is dropped. A new epoch restarts the stream
    (calling its ``set_epoch``, which reshuffles a ``datasets.IterableDataset``). Resuming skips the samples already
    used by reading past them: a stream cannot seek.
    """

    batches_per_epoch = None
    """Unknown for a stream."""

    def __init__(self, dataset: Any, global_batch_size: int, shard: Callable[[Sequence[int]], list[int]],
                 collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.shard = shard
        self.collate_fn = collate_fn
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Iterate epoch ``epoch`` from its micro-batch ``skip_batches`` on."""
        self.epoch = epoch
        self.skip = skip_batches

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        samples = iter(self.dataset)
        for _ in range(self.skip * self.global_batch_size):
            if next(samples, _END) is _END:
                return
        rows = self.shard(range(self.global_batch_size))
        while True:
            batch = list(itertools.islice(samples, self.global_batch_size))
            if len(batch) < self.global_batch_size:
                return
            yield self.collate_fn([batch[i] for i in rows]), len(rows)


_END = object()


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is iterable without a length (a stream) rather than map-style."""
    try:
        len(dataset)
    except TypeError:
        return hasattr(dataset, "__iter__")
    return False


def map_style_length(dataset: Any, name: str) -> int:
    """``len(dataset)``, or an error naming ``name`` for a dataset without one."""
    try:
        return len(dataset)
    except TypeError:
        raise MindFormersError(f"{name} must be a map-style dataset with a length (got {type(dataset).__name__}); "
                               "iterable datasets are not supported") from None
