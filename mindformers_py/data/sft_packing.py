"""Packed fine-tuning: tokenised samples of different lengths packed into rows of at most ``block_size`` tokens by
first-fit decreasing, each keeping its own positions (restarting at 0) so attention stays inside it, and a collator
that pads such rows without adding an attention mask.

Instruction data is length-skewed: padding every row of a batch to its longest sample spends most of the compute on
padding. Packed, a row holds several samples back to back; ``position_ids`` restart at each, which the models read as
document boundaries (:class:`~mindformers_py.layers.document_mask.DocumentMask`), so each sample's forward and
backward equal those of the sample alone. Labels keep their -100 (the prompt is not scored) and each sample's first
label is -100 too (it would be predicted from the previous sample's last token), as transformers'
``DataCollatorWithFlattening`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from ..errors import ConfigError
from ..layers.loss import IGNORE_INDEX


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths add up to at most ``capacity``: items taken longest first, each into the
    first bin (in order of opening) with room for it (O(n log n) with a max-tree over the bins' free room). Items
    longer than ``capacity`` are refused."""
    lengths = [int(x) for x in lengths]
    if any(x > capacity for x in lengths):
        raise ConfigError(f"a sample of {max(lengths)} tokens does not fit a packed row of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [-1] * (2 * size)  # a max-tree over bins' free room; -1: not opened
    bins: list[list[int]] = []
    for item in order:
        need = lengths[item]
        if free[1] >= need:  # the leftmost bin with room
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= need else 2 * node + 1
            slot = node - size
        else:
            slot = len(bins)
            bins.append([])
            node = size + slot
            free[node] = capacity
        bins[slot].append(item)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def pack_samples(samples: datasets.Dataset, block_size: int) -> datasets.Dataset:
    """Rows of ``input_ids`` / ``labels`` (any lengths up to ``block_size``) packed by :func:`first_fit_decreasing`
    into rows of ``input_ids``, ``labels`` and ``position_ids`` of at most ``block_size`` tokens (see the module
    docstring). The rows are in the order their bins were opened (longest first); training shuffles them."""
    for column in ("input_ids", "labels"):
        if column not in samples.column_names:
            raise ConfigError(f"packing needs a {column!r} column; the data has: {', '.join(samples.column_names)}")
    if len(samples) == 0:
        raise ConfigError("there is no sample to pack: every prompt is longer than block_size, or the data is empty; "
                          "raise data.block_size or check the data")
    table = samples.with_format("arrow")[:]  # the rows a select / shuffle left, not the whole underlying table
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    bins = first_fit_decreasing(lengths.tolist(), block_size)
    ids = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    labels = pc.list_flatten(table.column("labels")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in bins:
        spans = [np.arange(starts[i], starts[i + 1]) for i in members]
        take = np.concatenate(spans)
        row_labels = labels[take].copy()
        row_labels[np.cumsum([0] + [len(s) for s in spans[:-1]])] = IGNORE_INDEX  # no target across samples
        out["input_ids"].append(ids[take].tolist())
        out["labels"].append(row_labels.tolist())
        out["position_ids"].append(np.concatenate([np.arange(len(s)) for s in spans]).tolist())
    return datasets.Dataset.from_dict(out)


@dataclass
class PackedRowsCollator:
    """Collator of packed rows (``input_ids``, ``labels``, ``position_ids``, optionally ``shift_labels`` and
    ``attention_mask``): stacks them, right-padding shorter rows to the longest (rounded up to
    ``pad_to_multiple_of``) with ``pad_token_id``, labels -100 and positions that go on from the row's last, so the
    padding is the tail of the last document and never a document of its own. No attention mask is added (one would
    hide the documents' boundaries from attention)."""

    pad_token_id: int = 0
    """Token id of padding (never scored)."""
    pad_to_multiple_of: int | None = None
    """Round the padded length up to a multiple of this; None pads to the longest row."""

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [{k: torch.as_tensor(v) for k, v in ex.items()} for ex in examples]
        length = max(int(r["input_ids"].shape[-1]) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fills = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX,
                 "attention_mask": 0}  # (unpacked evaluation rows carry one; packed rows never need padding with it)
        batch = {}
        for key in rows[0]:
            padded = []
            for r in rows:
                value, extra = r[key], length - r[key].shape[-1]
                if extra and key == "position_ids":
                    value = torch.cat([value, value[-1] + torch.arange(1, extra + 1, dtype=value.dtype)])
                elif extra:
                    value = torch.nn.functional.pad(value, (0, extra), value=fills.get(key, 0))
                padded.append(value)
            batch[key] = torch.stack(padded)
        return batch
