"""The long-context recipe (tasks/gpt/pretrain_long.yaml), shrunk: its context-parallel layout, launched by the CLI on
2 processes, gives stand_alone's per-step losses; a length the ring cannot split is refused before any process
starts."""

import json
from pathlib import Path

from mindformers_py.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tasks" / "gpt" / "pretrain_long.yaml"
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))


def _small(tmp_path: Path) -> list[str]:
    (tmp_path / "train.txt").write_text(TEXT)
    (tmp_path / "val.txt").write_text(TEXT[:3000])
    return [str(RECIPE), "--data.source", "files", "--data.train_files", str(tmp_path / "train.txt"),
            "--data.validation_files", str(tmp_path / "val.txt"), "--data.block_size", "32", "--tokenizer.vocab_size",
            "300", "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.max_position_embeddings",
            "64", "--per_device_train_batch_size", "2",
            "--max_steps", "3", "--logging_steps", "1", "--report_to", "[]", "--disable_tqdm", "true",
            "--generate.prompts", "[]", "--bf16", "false"]  # fp32: compared to 1e-4


def _losses(outdir: Path) -> list[float]:
    history = json.loads((outdir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def test_long_context_recipe_gives_stand_alone_losses(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    small = _small(tmp_path)
    assert main(["run", *small, "--output_dir", str(tmp_path / "sa"), "--parallel_mode", "stand_alone"]) == 0
    assert main(["run", *small, "--output_dir", str(tmp_path / "cp2"), "--context_parallel", "2",
                 "--context_parallel_algo", "ring"]) == 0, capsys.readouterr().err
    single, split = _losses(tmp_path / "sa"), _losses(tmp_path / "cp2")
    assert len(single) == len(split) == 3
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(single, split)), (single, split)


def test_a_length_the_ring_cannot_split_is_refused_before_launch(tmp_path, capsys):
    code = main(["run", *_small(tmp_path), "--output_dir", str(tmp_path / "bad"), "--data.block_size", "30"])
    err = capsys.readouterr().err
    assert code == 2 and "sequence length 30 is not divisible by 2*context_parallel" in err, err
    assert not (tmp_path / "bad").exists()


def test_torch_compile_is_refused_before_launch(tmp_path, capsys):
    code = main(["run", *_small(tmp_path), "--output_dir", str(tmp_path / "bad"), "--torch_compile", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "torch_compile=True is not supported with context_parallel=2" in err, err
    assert not (tmp_path / "bad").exists()
