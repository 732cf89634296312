"""A global batch the data-parallel ranks do not divide is split unevenly (shares differing by one sample at most,
together the batch once, in order), and a rank without a share reads the batch's first sample as padding that counts
for nothing (it raised "cannot be split evenly over data_parallel=2 ranks"). The layouts' training, evaluation and
prediction on such batches are compared with stand-alone's in tests/recipes/test_recipe_layouts.py and
tests/trainer/test_peft_from_python.py."""

from __future__ import annotations

import pytest

from mindformers_py.engine.distributed import DistributedEngine
from mindformers_py.trainer.batching import GlobalBatchSampler


def rank(dp_rank: int, dp_size: int) -> DistributedEngine:
    engine = object.__new__(DistributedEngine)  # only the data-parallel coordinates matter here
    engine.dp_rank, engine.dp_size = dp_rank, dp_size
    return engine


@pytest.mark.parametrize("rows, dp", [(7, 2), (7, 3), (2, 3), (1, 2), (8, 4)])
def test_shares_cover_the_batch_once_in_order(rows, dp):
    shares = [rank(r, dp).batch_share(rows) for r in range(dp)]
    assert [count for _, count in shares] == [rows // dp + (r < rows % dp) for r in range(dp)]
    indices = list(range(100, 100 + rows))
    read = [rank(r, dp).shard_indices(indices) for r in range(dp)]
    real = [index for part, (_, count) in zip(read, shares) for index in part[:count]]
    assert real == indices
    for part, (_, count) in zip(read, shares):
        assert part == (part[:count] or [indices[0]])  # a rank without a share reads the first sample as padding


def test_the_sampler_says_how_many_rows_of_each_batch_are_samples():
    """13 samples in global batches of 4 over 2 ranks: rank 1 reads 2, 2, 2 samples, then a padding row."""
    engine = rank(1, 2)
    sampler = GlobalBatchSampler(13, 4, engine.shard_indices, shuffle=False, share=engine.batch_share)
    assert list(sampler) == [[2, 3], [6, 7], [10, 11], [12]]
    assert list(sampler.real_rows()) == [2, 2, 2, 0]
    first = rank(0, 2)
    sampler = GlobalBatchSampler(13, 4, first.shard_indices, shuffle=False, share=first.batch_share)
    assert list(sampler)[-1] == [12] and list(sampler.real_rows()) == [2, 2, 2, 1]
