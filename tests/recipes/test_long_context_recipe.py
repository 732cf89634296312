"""The long-context recipe (tasks/gpt/pretrain_long.yaml), shrunk: a length the ring cannot split, and torch_compile,
are refused before any process starts (its context-parallel layout is compared with stand-alone in
test_recipe_layouts.py)."""

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
            "--generate.prompts", "[]", "--bf16", "false"]


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
