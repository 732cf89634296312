"""T5's span corruption (Raffel et al., 2020, section 3.1.4): the pretraining objective of encoder-decoders.

A block of ``length`` tokens has ``round(length * noise_density)`` of them masked, in ``round(noise /
mean_noise_span_length)`` spans. Spans of kept and masked tokens alternate, starting with kept ones and ending with
masked ones (as T5's ``random_spans_noise_mask``); the lengths of both kinds are random partitions of their
totals. The encoder input puts sentinel ``k`` in place of the ``k``-th masked span; the target lists each masked
span after its sentinel:

    text     the quick brown fox jumps over the lazy dog
    input    the quick <extra_id_0> jumps over the lazy <extra_id_1> </s>
    target   <extra_id_0> brown fox <extra_id_1> dog </s>

The spans of a sample are a function of (seed, sample index) only: every parallel layout, worker and epoch
corrupts sample ``i`` the same way. All samples of one length have inputs and targets of one length each, so
batches need no padding.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import datasets
import torch

from ..errors import ConfigError


def span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(masked tokens, masked spans) of a block of ``length`` tokens (at least one of each, and one kept token)."""
    if not 0 < noise_density < 1:
        raise ConfigError(f"noise_density={noise_density!r} is not valid; expected a fraction between 0 and 1")
    if mean_noise_span_length < 1:
        raise ConfigError(f"mean_noise_span_length={mean_noise_span_length!r} is not valid; expected at least 1")
    noise = min(max(round(length * noise_density), 1), length - 1)
    spans = max(round(noise / mean_noise_span_length), 1)
    return noise, min(spans, noise, length - noise)


def corrupted_lengths(length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """(input tokens, target tokens) of a corrupted block of ``length`` tokens, eos included."""
    noise, spans = span_counts(length, noise_density, mean_noise_span_length)
    return length - noise + spans + 1, noise + spans + 1


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A generator seeded by (seed, index) alone."""
    digest = hashlib.sha256(f"span-corruption:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _partition(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """``total`` split into ``parts`` positive lengths, uniformly over the ways to place the cuts."""
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
               generator: torch.Generator) -> list[bool]:
    """Which of ``length`` positions are masked: kept and masked spans alternating, kept first."""
    noise, spans = span_counts(length, noise_density, mean_noise_span_length)
    kept = _partition(length - noise, spans, generator)
    masked = _partition(noise, spans, generator)
    mask: list[bool] = []
    for k, m in zip(kept, masked):
        mask += [False] * k + [True] * m
    return mask


def span_corrupt(
    ids: Sequence[int],
    sentinels: Sequence[int],
    eos_id: int,
    seed: int,
    index: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[list[int], list[int]]:
    """(encoder input, target) of sample ``index``'s tokens ``ids`` (see the module docstring). ``sentinels`` are the
    sentinel ids in order (``<extra_id_0>`` first)."""
    mask = noise_mask(len(ids), noise_density, mean_noise_span_length, sample_generator(seed, index))
    spans = sum(1 for i, m in enumerate(mask) if m and not mask[i - 1])  # mask[0] is always a kept token
    if spans > len(sentinels):
        raise ConfigError(f"span corruption of {len(ids)} tokens makes {spans} spans but the tokenizer has "
                          f"{len(sentinels)} sentinel tokens; lower data.block_size or use more extra_ids")
    inputs: list[int] = []
    targets: list[int] = []
    span = -1
    for i, (token, masked) in enumerate(zip(ids, mask)):
        if masked:
            if not mask[i - 1]:  # a masked span starts: its sentinel stands in for it, and opens it in the target
                span += 1
                inputs.append(sentinels[span])
                targets.append(sentinels[span])
            targets.append(token)
        else:
            inputs.append(token)
    return inputs + [eos_id], targets + [eos_id]


def span_corruption_dataset(blocks: datasets.Dataset, sentinels: Sequence[int], eos_id: int, seed: int,
                            noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> datasets.Dataset:
    """Blocks of token ids (an ``input_ids`` column, e.g. :func:`~mindformers_py.data.packing.pack_dataset`'s) as
    span-corruption samples: ``input_ids`` (encoder input) and ``labels`` (target), row ``i`` corrupted by
    :func:`span_corrupt` with (``seed``, ``i``)."""
    def corrupt(batch: dict, indices: list[int]) -> dict:
        pairs = [span_corrupt(ids, sentinels, eos_id, seed, i, noise_density, mean_noise_span_length)
                 for ids, i in zip(batch["input_ids"], indices)]
        return {"input_ids": [p[0] for p in pairs], "labels": [p[1] for p in pairs]}

    return blocks.map(corrupt, with_indices=True, batched=True, remove_columns=blocks.column_names,
                      desc="Span corruption")
