"""Training on an iterable dataset (a stream), as transformers' Trainer does with ``max_steps``: the same global
batches under any layout, exact resume (the data position is restored) and data parallelism (each rank its share)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from torch.utils.data import IterableDataset

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.errors import MindFormersError
from test_trainer import args, token_data, tiny_gpt, train_losses

STEPS, SAVE_AT = 6, 3


class TokenStream(IterableDataset):
    """A stream of 20 token rows (fewer than the run needs: epochs restart it); counts its passes."""

    def __init__(self) -> None:
        self.rows = token_data(20, seed=3)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        yield from self.rows


def _run(tmp_path, stream, name, parallel=None, resume=None, stop=None, **kw):
    run = dict(max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, per_device_train_batch_size=4,
               gradient_accumulation_steps=2)
    run.update(kw)
    if parallel is not None:
        run.update(parallel_config=parallel, per_device_train_batch_size=4 // parallel.dp)
    trainer = mf.Trainer(model=tiny_gpt(dropout=0.0), args=args(tmp_path, name, **run), train_dataset=stream)
    trainer.train(resume_from_checkpoint=resume)
    trainer.engine.teardown()
    return train_losses(trainer.state)


@pytest.mark.parametrize("kind", ["torch", "datasets"])
def test_stream_trains_for_max_steps_and_resumes_exactly(tmp_path, kind):
    make = TokenStream if kind == "torch" else lambda: Dataset.from_list(token_data(20, seed=3)).to_iterable_dataset()
    stream = make()
    full = _run(tmp_path, stream, "full")
    assert sorted(full) == list(range(1, STEPS + 1))
    if kind == "torch":  # 20 rows, 8 per step: the stream ran through several epochs
        assert stream.epochs[:2] == [0, 1]
    resumed = _run(tmp_path, make(), "full", resume=str(tmp_path / "full" / f"checkpoint-{SAVE_AT}"))
    assert {s: resumed[s] for s in range(SAVE_AT + 1, STEPS + 1)} == {s: full[s] for s in range(SAVE_AT + 1, STEPS + 1)}


def test_a_stream_without_max_steps_is_refused(tmp_path):
    trainer = mf.Trainer(model=tiny_gpt(), args=args(tmp_path), train_dataset=TokenStream())
    with pytest.raises(MindFormersError, match="iterable train_dataset has no length.*max_steps > 0"):
        trainer.train()


def _dp2(rank, world, folder):
    return _run_path(folder, mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=2))


def _run_path(folder, parallel):
    from pathlib import Path

    return _run(Path(folder), TokenStream(), "dp2" if parallel.dp > 1 else "one", parallel=parallel, save_strategy="no")


def test_data_parallel_ranks_read_their_share_of_each_global_batch(tmp_path):
    expected = _run_path(str(tmp_path), mf.ParallelConfig())
    for losses in run_workers(_dp2, 2, str(tmp_path)):
        assert losses == pytest.approx(expected, rel=1e-4)


def test_an_iterable_eval_dataset_is_evaluated_whole(tmp_path):
    data = token_data(10, seed=5)
    trainer = mf.Trainer(model=tiny_gpt(dropout=0.0), args=args(tmp_path, per_device_eval_batch_size=3),
                         eval_dataset=Dataset.from_list(data).to_iterable_dataset())
    streamed = trainer.evaluate()
    listed = trainer.evaluate(Dataset.from_list(data))
    assert streamed["eval_loss"] == pytest.approx(listed["eval_loss"], rel=1e-6)
    assert torch.isfinite(torch.tensor(streamed["eval_loss"]))
