"""tasks/vit/finetune_digits.yaml: trains (small settings here), saves the image processor with the model, reports
held-out accuracy, evaluates and predicts on its output; its layouts (augmentation on: every layout must see the same
images) are compared with stand-alone in test_recipe_layouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindformers_py.cli import main
from mindformers_py.data.images import digits_dataset

RECIPE = Path(__file__).resolve().parents[2] / "tasks" / "vit" / "finetune_digits.yaml"
SMALL = ["--model.hidden_size", "32", "--model.num_hidden_layers", "2", "--model.intermediate_size", "64",
         "--report_to", "[]", "--disable_tqdm", "true", "--logging_steps", "1"]


def run_cli(*args, capsys):
    code = main(["run", str(RECIPE), *map(str, args)])
    return code, capsys.readouterr()


def test_recipe_trains_evaluates_and_predicts(tmp_path, capsys):
    out = tmp_path / "run"
    code, res = run_cli(*SMALL, "--max_steps", "20", "--eval_steps", "20", "--save_steps", "20", "--warmup_steps", "5",
                        "--output_dir", out, capsys=capsys)
    assert code == 0, res.err
    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "run_config.yaml", "log.jsonl"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint-20" / "preprocessor_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mindformers_vit" and config["id2label"]["7"] == "7"
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    accuracy = [h["eval_accuracy"] for h in history if "eval_accuracy" in h][-1]  # the full run's figure: the card

    code, res = run_cli("--run_mode", "eval", "--model.name_or_path", out, "--output_dir", tmp_path / "eval", *SMALL,
                        capsys=capsys)
    assert code == 0, res.err
    assert f"eval_accuracy={accuracy:.4g}" in res.out

    image = tmp_path / "digit.png"
    digits_dataset()["validation"][0]["image"].save(image)
    code, res = run_cli("--run_mode", "predict", "--model.name_or_path", out, "--output_dir", tmp_path / "predict",
                        "--generate.prompts", f"[{image}]", *SMALL, capsys=capsys)
    assert code == 0, res.err
    assert "'label':" in (tmp_path / "predict" / "predictions.txt").read_text()


@pytest.mark.parametrize("flags, needle", [
    (["--parallel_mode", "semi_auto_parallel", "--model_parallel", "2", "--use_seq_parallel", "true",
      "--model.patch_size", "7"], "17 tokens"),
    (["--data.source", "stdlib"], "'digits', 'imagefolder'"),
    (["--data.source", "imagefolder", "--data.train_files", "/nonexistent"], "does not exist"),
    (["--model.image_size", "30"], "patch_size=4"),
])
def test_recipe_errors_are_one_line(flags, needle, tmp_path, capsys):
    code, res = run_cli(*flags, "--output_dir", tmp_path / "out", capsys=capsys)
    assert code == 2 and "Traceback" not in res.err
    assert needle in res.err.strip().splitlines()[-1], res.err
