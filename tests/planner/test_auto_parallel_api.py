"""``parallel_mode="auto_parallel"`` from the Python API: the Trainer's engine plans a layout for the run's
processes (one process: stand-alone; two gloo processes: a two-rank layout) and trains on stand-alone's curve."""

from __future__ import annotations

import json

import pytest
import torch

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.engine import DistributedEngine, Engine

VOCAB, SEQ, STEPS = 64, 16, 3


def _train(folder: str, parallel: mf.ParallelConfig) -> tuple[list[float], str, str]:
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           max_position_embeddings=SEQ))
    ids = torch.randint(0, VOCAB, (4 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row} for row in ids]
    args = mf.TrainingArguments(output_dir=folder, per_device_train_batch_size=4 // (2 if parallel.dp > 1 else 1),
                                max_steps=STEPS, logging_steps=1, learning_rate=1e-2, save_strategy="no", report_to="none",
                                disable_tqdm=True, plot_loss_curve=False, use_cpu=True, parallel_config=parallel,
                                bf16=False)
    trainer = mf.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    engine = trainer.engine
    engine.teardown()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], type(engine).__name__, \
        engine.layout.parallel_mode


def _layout(folder) -> list[str]:
    """The layout lines the run recorded (log.jsonl)."""
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    return [r["layout"] for r in records if "layout" in r]


def test_one_process_plans_stand_alone(tmp_path):
    losses, engine, mode = _train(str(tmp_path / "auto"), mf.ParallelConfig(parallel_mode="auto_parallel"))
    assert (engine, mode) == (Engine.__name__, "stand_alone")
    [line] = _layout(tmp_path / "auto")  # the layout, then what the planner chose and why
    assert line.startswith("1 process (stand_alone): dp=1 tp=1 pp=1 ep=1, no ZeRO, recompute=off; auto_parallel "
                           "chose dp=1 tp=1 pp=1") and "fastest estimated throughput" in line
    expected, _, _ = _train(str(tmp_path / "ref"), mf.ParallelConfig())
    assert losses == pytest.approx(expected, rel=1e-6)


def _two_ranks(rank: int, world: int, folder: str):
    # The global batch is 4 samples whatever the layout: per-device batch 2 on each of the two ranks.
    return _train(folder, mf.ParallelConfig(parallel_mode="auto_parallel", data_parallel=2))


def test_two_processes_plan_a_two_rank_layout_with_stand_alone_losses(tmp_path):
    expected, _, _ = _train(str(tmp_path / "ref"), mf.ParallelConfig())
    for losses, engine, mode in run_workers(_two_ranks, 2, str(tmp_path / "auto")):
        assert mode == "semi_auto_parallel" and engine in (DistributedEngine.__name__, "PipeliningEngine")
        assert losses == pytest.approx(expected, rel=1e-4)
    [line] = _layout(tmp_path / "auto")
    assert line.startswith("2 processes (semi_auto_parallel): ") and "; auto_parallel chose " in line
