"""Task recipes and the CLI: overrides, resolved config, run modes, one-line errors with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mindformers_py.cli import main
from mindformers_py.errors import ConfigError
from mindformers_py.recipes import apply_overrides, load_recipe, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))


@pytest.fixture
def recipe(tmp_path):
    (tmp_path / "train.txt").write_text(TEXT)
    (tmp_path / "val.txt").write_text(TEXT[:3000])
    data = {
        "run_mode": "train",
        "model": {"name_or_path": "gpt_tiny", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "max_position_embeddings": 64},
        "tokenizer": {"vocab_size": 300},
        "data": {"source": "files", "train_files": str(tmp_path / "train.txt"), "validation_files": str(tmp_path / "val.txt"), "block_size": 32},
        "training": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "max_steps": 3, "logging_steps": 1,
                     "learning_rate": 0.01, "report_to": [], "disable_tqdm": True, "save_strategy": "no"},
        "parallel": {"parallel_mode": "stand_alone"},
        "generate": {"prompts": ["def function_"], "max_new_tokens": 5},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args, capsys):
    code = main(["run", *map(str, args)])
    return code, capsys.readouterr()


def test_recipe_runs_and_resolved_config_reruns(recipe, tmp_path, capsys, caplog, monkeypatch):
    # stand_alone with a data-parallel size runs one process: a one-line warning says so and run_config.yaml records
    # what ran. The run's first line (and log record) is its layout.
    code, out = run_cli(recipe, "--max_steps", "2", "--model.num_layers", "1", "--data_parallel", "2",
                        "--generate.do_sample", "true", capsys=capsys)
    assert code == 0, out.err
    outdir = tmp_path / "out"
    for name in ("run_config.yaml", "log.jsonl", "loss_curve.png", "model.safetensors", "tokenizer.json", "samples.txt", "trainer_state.json"):
        assert (outdir / name).is_file(), name
    resolved = yaml.safe_load((outdir / "run_config.yaml").read_text())
    assert resolved["training"]["max_steps"] == 2 and resolved["model"]["num_layers"] == 1
    assert resolved["parallel"]["data_parallel"] == 1
    warned = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert warned == ["parallel_mode='stand_alone' runs one process, so data_parallel=2 is not applied; set "
                      "parallel_mode='data_parallel' to run 2 processes"]
    layout = "1 process (stand_alone): dp=1 tp=1 pp=1 ep=1, no ZeRO, recompute=off"
    assert out.out.splitlines().count(layout) == 1
    assert json.loads((outdir / "log.jsonl").read_text().splitlines()[0])["layout"] == layout
    state = json.loads((outdir / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["log_history"][0]["layout"] == layout
    samples = (outdir / "samples.txt").read_text()
    assert "def function_" in samples
    # The saved recipe runs again as is (here: evaluating the trained model), its model frozen: under a layout a
    # trainable one would be held twice by data parallelism's replicate (a Qwen3-MoE slice's ep2 evaluation peaked at
    # 10.5 GiB a rank trainable, 3.5 GiB frozen)
    import mindformers_py.trainer as trainers

    trainable, real_init = [], trainers.Trainer.__init__

    def spy(self, model=None, *args, **kwargs):
        trainable.append(any(p.requires_grad for p in model.parameters()))
        real_init(self, model, *args, **kwargs)

    monkeypatch.setattr(trainers.Trainer, "__init__", spy)
    code, out = run_cli(outdir / "run_config.yaml", "--run_mode", "eval", "--model.name_or_path", outdir,
                        "--output_dir", tmp_path / "eval", capsys=capsys)
    assert code == 0, out.err
    assert trainable == [False]
    # Predicting into the run's folder writes beside its samples, and the same ones: sampling starts from the seed.
    code, out = run_cli(outdir / "run_config.yaml", "--run_mode", "predict", "--model.name_or_path", outdir,
                        capsys=capsys)
    assert code == 0, out.err
    assert (outdir / "predictions.txt").read_text() == samples == (outdir / "samples.txt").read_text()


def test_output_dir_with_another_run_is_refused(recipe, capsys):
    assert run_cli(recipe, capsys=capsys)[0] == 0
    code, out = run_cli(recipe, "--save_strategy", "steps", "--save_steps", "1", capsys=capsys)
    assert code == 2 and "output_dir" in out.err and "Traceback" not in out.err


def test_parse_overrides_types():
    assert parse_overrides(["--max_steps", "8", "--bf16=true", "--model.num_layers", "4", "--report_to", "[]", "--run_name", "x y"]) == [
        ("max_steps", 8), ("bf16", True), ("model.num_layers", 4), ("report_to", []), ("run_name", "x y")]


def test_overrides_route_bare_and_dotted_names():
    recipe = apply_overrides({}, parse_overrides(["--max_steps", "5", "--parallel_mode", "data_parallel", "--data_parallel", "2",
                                                  "--model.num_layers", "4", "--run_mode", "eval", "--parallel.recompute", "full"]))
    assert recipe == {"training": {"max_steps": 5}, "parallel": {"parallel_mode": "data_parallel", "data_parallel": 2, "recompute": "full"},
                      "model": {"num_layers": 4}, "run_mode": "eval"}


@pytest.mark.parametrize("flag, needle", [
    ("--max_step", "--max_steps"),            # typo: suggestion
    ("--data.blocksize", "block_size"),       # unknown field of a section
    ("--nosection.x", "valid: model"),        # unknown section
])
def test_unknown_override_keys(flag, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, parse_overrides([flag, "1"]))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_values_and_files_give_one_line_errors(recipe, tmp_path, capsys):
    cases = [
        ([recipe, "--parallel_mode", "magic"], "parallel_mode"),
        ([recipe, "--run_mode", "serve"], "run_mode"),
        ([recipe, "--lr_scheduler_type", "zigzag"], "lr_scheduler_type"),
        ([recipe, "--model.name_or_path", "gpt_huge"], "gpt_tiny"),
        ([tmp_path / "missing.yaml"], "missing.yaml"),
        ([recipe, "--data_parallel", "2", "--parallel_mode", "semi_auto_parallel", "--model_parallel", "3"], "model_parallel"),
        ([recipe, "--data.block_size", "4096"], "block"),
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: gpt_tiny\n training: [\n")
    cases.append(([bad], "bad.yaml:3"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: {name_or_path: gpt_tiny}\ntrainig: {max_steps: 1}\n")
    cases.append(([unknown], "trainig"))
    for args, needle in cases:
        code, out = run_cli(*args, capsys=capsys)
        assert code == 2, (args, out.err)
        assert "Traceback" not in out.err, out.err
        err = out.err.strip().splitlines()[-1]  # progress bars may come before it
        assert err.startswith("error:") and needle in err, (args, err)


def test_python_dash_m_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mindformers_py", "run", str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_shipped_recipes_parse():
    for path in (ROOT / "tasks").rglob("*.yaml"):
        load_recipe(path)


def _losses(outdir: Path) -> list[float]:
    history = json.loads((outdir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def test_one_flag_switches_to_distributed_with_the_same_losses(recipe, tmp_path, capsys, monkeypatch):
    """The same recipe, stand_alone vs --parallel_mode semi_auto_parallel (dp2 x tp2, 4 processes launched by the CLI);
    the distributed run's checkpoint resumes stand-alone through the CLI on the same curve."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = [recipe, "--generate.prompts", "[]", "--max_steps", "3", "--bf16", "false"]  # fp32: compared to 1e-4
    assert run_cli(*base, "--output_dir", tmp_path / "sa", capsys=capsys)[0] == 0
    code, out = run_cli(*base, "--output_dir", tmp_path / "dist", "--parallel_mode", "semi_auto_parallel",
                        "--data_parallel", "2", "--model_parallel", "2", "--per_device_train_batch_size", "2",
                        "--save_strategy", "steps", "--save_steps", "2", "--max_restarts", "1", capsys=capsys)
    assert code == 0, out.err
    single, dist = _losses(tmp_path / "sa"), _losses(tmp_path / "dist")
    assert len(single) == len(dist) == 3
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(single, dist)), (single, dist)
    code, out = run_cli(*base, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint",
                        tmp_path / "dist" / "checkpoint-2", capsys=capsys)
    assert code == 0, out.err
    resumed = _losses(tmp_path / "resumed")
    assert len(resumed) == 3 and abs(resumed[2] - single[2]) <= 1e-4 * abs(single[2]), (single, resumed)


def test_yaml_and_flags_read_values_by_the_fields_type(recipe, tmp_path, capsys):
    """``no``/``off``/``none`` are strings for string fields (not YAML 1.1 booleans) and booleans for boolean ones."""
    data = yaml.safe_load(recipe.read_text())
    text = yaml.safe_dump(data).replace("save_strategy: 'no'", "save_strategy: no")
    text += "\n".join(["", "generate:", "  prompts: ['def function_']", "  max_new_tokens: 3", "  do_sample: no"])
    assert "save_strategy: no\n" in text
    path = tmp_path / "typed.yaml"
    path.write_text(text)
    assert load_recipe(path)["training"]["save_strategy"] == "no"
    code, out = run_cli(path, "--eval_strategy", "no", "--report_to", "none", "--plot_loss_curve", "off",
                        "--max_steps", "1", "--model.tie_word_embeddings", "no", capsys=capsys)
    assert code == 0, out.err
    resolved = yaml.safe_load((tmp_path / "out" / "run_config.yaml").read_text())
    assert resolved["training"]["eval_strategy"] == "no" and resolved["training"]["report_to"] == "none"
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False
    assert not (tmp_path / "out" / "loss_curve.png").exists()


def test_sequence_classification_recipe_trains_evaluates_and_predicts(tmp_path, capsys):
    """A recipe with ``task: text_classification`` loads a classifier, numbers string labels, reports accuracy and
    F1 and runs the text-classification pipeline on the prompts."""
    import csv

    rows = [("def add(a, b): return a + b", "math"), ("print('hello world')", "io"), ("x = a * b - c", "math"),
            ("open(path).read()", "io")] * 12
    for name, part in (("train.csv", rows), ("val.csv", rows[:8])):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["code", "kind"])
            writer.writerows(part)
    recipe = {
        "task": "text_classification",
        "model": {"name_or_path": "gpt_tiny", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                  "max_position_embeddings": 64},
        "tokenizer": {"vocab_size": 300},
        "data": {"source": "files", "train_files": str(tmp_path / "train.csv"), "validation_files": str(tmp_path / "val.csv"),
                 "text_column": "code", "label_column": "kind", "block_size": 32},
        "training": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "max_steps": 4,
                     "learning_rate": 0.01, "report_to": [], "disable_tqdm": True, "save_strategy": "no",
                     "eval_strategy": "steps", "eval_steps": 4},
        "generate": {"prompts": ["print('again')"]},
    }
    path = tmp_path / "cls.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, out = run_cli(path, capsys=capsys)
    assert code == 0, out.err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["GPTForSequenceClassification"] and config["id2label"] == {"0": "io", "1": "math"}
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_accuracy" in h]
    assert evals and {"eval_f1", "eval_precision", "eval_recall", "eval_loss"} <= set(evals[-1])
    assert "'label': 'io'" in out.out or "'label': 'math'" in out.out
    code, out = run_cli(path, "--run_mode", "eval", "--model.name_or_path", tmp_path / "out", "--output_dir",
                        tmp_path / "eval", capsys=capsys)
    assert code == 0, out.err


def test_a_task_without_recipe_data_is_refused(recipe, capsys):
    code, out = run_cli(recipe, "--task", "question_answering", capsys=capsys)
    assert code == 2 and "task='question_answering'" in out.err and "causal_lm" in out.err
    code, out = run_cli(recipe, "--task", "image_classification", capsys=capsys)  # a task GPT models do not serve
    assert code == 2 and "gpt family" in out.err and "Traceback" not in out.err


def test_a_run_stopped_during_its_final_evaluation_has_already_saved_its_model(recipe, monkeypatch, capsys):
    """Evaluation (generation metrics above all) can take long: the trained model is written before the last
    evaluation starts, so stopping the run there loses nothing."""
    import mindformers_py as mf
    from mindformers_py.trainer.trainer import Trainer

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "evaluate", stopped)
    outdir = Path(yaml.safe_load(recipe.read_text())["training"]["output_dir"])
    code, out = run_cli(recipe, "--eval_strategy", "steps", "--eval_steps", "3", capsys=capsys)
    assert code == 130 and out.err.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C)")  # one line
    assert (outdir / "config.json").is_file() and (outdir / "model.safetensors").is_file()
    saved = mf.AutoModelForCausalLM.from_pretrained(outdir)
    assert saved.config.num_hidden_layers == 1
