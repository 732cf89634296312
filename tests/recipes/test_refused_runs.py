"""A run that is refused changes nothing: every check that can refuse it happens before its first byte is written,
so the folder it was pointed at keeps every file as it found it (bytes and times), whether the run came from the
CLI, from torchrun or from a Trainer in Python. The refusal of a folder holding another run names a new
``--output_dir`` first and overwriting last."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mindformers_py as mf
from mindformers_py.cli import main
from mindformers_py.data import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200))


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every file and folder under ``folder``: its bytes (hashed), size and modification time."""
    found = {}
    for path in sorted([folder, *folder.rglob("*")]):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        found[str(path.relative_to(folder))] = (digest, stat.st_size if path.is_file() else 0, stat.st_mtime_ns)
    return found


@pytest.fixture
def earlier_run(tmp_path):
    """A folder holding a finished run: a model, its tokenizer, a checkpoint, the trainer state, the resolved
    recipe. Its times are set in the past, so that a rewrite of the same bytes is seen too."""
    folder = tmp_path / "runs" / "demo"
    tokenizer = train_bpe_tokenizer([TEXT], 300)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(flavour="gpt2", vocab_size=len(tokenizer), hidden_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "checkpoint-4").mkdir()
    (folder / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    (folder / "trainer_state.json").write_text('{"global_step": 4}')
    (folder / "run_config.yaml").write_text("the recipe of the run that made this model\n")
    (folder / "log.jsonl").write_text('{"loss": 1.0}\n')
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, ns=(10**18, 10**18))
    (tmp_path / "train.txt").write_text(TEXT)
    return folder


def _recipe_flags(tmp_path: Path) -> list[str]:
    return ["--model.name_or_path", "gpt_tiny", "--model.num_hidden_layers", "1", "--model.hidden_size", "32",
            "--model.num_attention_heads", "2", "--data.source", "files", "--data.train_files",
            str(tmp_path / "train.txt"), "--data.block_size", "32", "--tokenizer.vocab_size", "300", "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--eval_strategy", "no", "--report_to", "none"]


_HOLDS_ANOTHER_RUN = ("holds another run (checkpoint-4, trainer_state.json); give this run a new output_dir "
                      "(--output_dir runs/<new name>), continue that run with resume_from_checkpoint=True, or delete "
                      "its checkpoints and train over it with overwrite_output_dir=True")


@pytest.mark.parametrize("layout", [[], ["--parallel_mode", "data_parallel", "--data_parallel", "2"]],
                         ids=["one-process", "two-processes"])
def test_the_cli_refuses_a_folder_holding_another_run_and_changes_nothing(earlier_run, tmp_path, monkeypatch, capsys,
                                                                        layout):
    monkeypatch.chdir(tmp_path)
    before = snapshot(earlier_run)
    code = main(["run", str(ROOT / "tasks/gpt/pretrain_tiny.yaml"), *_recipe_flags(tmp_path), *layout])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [f"error: output_dir='runs/demo' {_HOLDS_ANOTHER_RUN}"]
    assert snapshot(earlier_run) == before


def test_a_refused_run_under_torchrun_changes_nothing(earlier_run, tmp_path):
    before = snapshot(earlier_run)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mindformers_py",
         "run", str(ROOT / "tasks/gpt/pretrain_tiny.yaml"), *_recipe_flags(tmp_path), "--parallel_mode",
         "data_parallel", "--data_parallel", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert errors == [f"error: output_dir='runs/demo' {_HOLDS_ANOTHER_RUN}"], out.stderr[-3000:]
    assert snapshot(earlier_run) == before


def test_a_trainer_refused_in_python_changes_nothing(earlier_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tokenizer = mf.AutoTokenizer.from_pretrained(earlier_run) if hasattr(mf, "AutoTokenizer") else None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(earlier_run)
    model = mf.AutoModelForCausalLM.from_pretrained(earlier_run)
    ids = tokenizer(TEXT[:2000])["input_ids"]
    train = [{"input_ids": ids[i:i + 16], "labels": ids[i:i + 16]} for i in range(0, 16 * 8, 16)]
    before = snapshot(earlier_run)
    refusals = [
        # another run's checkpoints, with overwrite_output_dir=False (transformers 5 trains over them by default)
        (dict(output_dir="runs/demo", overwrite_output_dir=False), train, _HOLDS_ANOTHER_RUN),
        # fewer samples than one batch: refused before the folder is prepared (overwriting would delete the run)
        (dict(output_dir="runs/demo", overwrite_output_dir=True, per_device_train_batch_size=64), train,
         "fewer than one batch"),
    ]
    for fields, data, message in refusals:
        args = mf.TrainingArguments(max_steps=2, report_to="none", disable_tqdm=True, **fields)
        trainer = mf.Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        with pytest.raises(mf.MindFormersError, match=message.replace("(", r"\(").replace(")", r"\)")):
            trainer.train()
        assert snapshot(earlier_run) == before, fields
