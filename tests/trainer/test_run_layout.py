"""The Trainer says what it started: one layout line (printed once, first in log.jsonl and trainer_state.json), and a
one-line warning for layout sizes its mode does not apply."""

from __future__ import annotations

import json
import logging

import torch

import mindformers_py as mf


def test_stand_alone_with_a_data_parallel_size_warns_and_prints_its_layout(tmp_path, capsys, caplog):
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           max_position_embeddings=16))
    data = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(4)]
    args = mf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                                report_to="none", disable_tqdm=True, plot_loss_curve=False, use_cpu=True,
                                parallel_config=mf.ParallelConfig(data_parallel=2, recompute="full"))
    with caplog.at_level(logging.WARNING, logger="mindformers_py"):
        trainer = mf.Trainer(model=model, args=args, train_dataset=data)
    assert [r.getMessage() for r in caplog.records] == [
        "parallel_mode='stand_alone' runs one process, so data_parallel=2 is not applied; set "
        "parallel_mode='data_parallel' to run 2 processes"]
    trainer.train()
    layout = "1 process (stand_alone): dp=1 tp=1 pp=1 ep=1, no ZeRO, recompute=full"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == layout and printed.count(layout) == 1
    assert json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])["layout"] == layout
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    assert history[0]["layout"] == layout and history[1]["step"] == 1 and "loss" in history[1]  # loss from step 1
