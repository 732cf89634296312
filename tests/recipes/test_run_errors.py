"""Errors a run meets, each one clear line: an output_dir that is a file, a typo in the model section (with the
name meant), the per-device batch by its argument's name, sequence parallelism asked for without tensor
parallelism (said on the layout line), a user error every rank meets after the ranks started (printed once, not
once per rank), and Ctrl-C on a multi-process run (one line, every process stopped, exit status 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig
from mindformers_py.trainer.arguments import TrainingArguments

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tasks" / "gpt" / "pretrain_tiny.yaml"
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))


def test_an_output_dir_that_is_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^output_dir='.*taken' is a file, not a folder"):
        TrainingArguments(output_dir=str(tmp_path / "taken"))
    with pytest.raises(ConfigError, match=r"^output_dir='.*taken/run' lies inside '.*taken', which is a file"):
        TrainingArguments(output_dir=str(tmp_path / "taken" / "run"))


def test_a_model_section_typo_names_the_field_meant():
    from mindformers_py.auto import resolve_config

    with pytest.raises(ConfigError) as err:
        resolve_config("gpt_tiny", num_hiden_layers=2)
    assert str(err.value) == ("'num_hiden_layers' is not a GPTConfig field nor a from_pretrained argument; did you mean "
                              "'num_hidden_layers'?")


def test_the_per_device_batch_is_named_as_the_argument_is():
    layout = ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=3)
    with pytest.raises(ConfigError, match=r"^per_device_train_batch_size=4 is not divisible by micro_batch_num=3"):
        layout.validate_for(2, per_device_batch=4)


def test_sequence_parallel_without_tensor_parallel_is_said_on_the_layout_line():
    layout = ParallelConfig(parallel_mode="data_parallel", data_parallel=2, use_seq_parallel=True)
    assert layout.describe() == ("dp=2 tp=1 pp=1 ep=1, no ZeRO, recompute=off, use_seq_parallel ignored (it splits "
                                 "sequences over model_parallel > 1 ranks)")
    applied = ParallelConfig(parallel_mode="semi_auto_parallel", model_parallel=2, use_seq_parallel=True)
    assert applied.describe().endswith(", sequence parallel")


def _command(tmp_path: Path, cache: Path, *extra: str) -> list[str]:
    text = cache.parent / "run_errors_train.txt"  # one file for both runs: their tokenizer and data are cached once
    if not text.exists():
        text.write_text(TEXT)
    return [sys.executable, "-m", "mindformers_py", "run", str(RECIPE), "--data.source", "files",
            "--data.train_files", str(text), "--data.validation_files", str(text),
            "--data.max_eval_samples", "4", "--tokenizer.vocab_size", "300", "--model.num_hidden_layers", "1",
            "--model.hidden_size", "32", "--data.block_size", "16", "--per_device_train_batch_size", "2",
            "--report_to", "[]", "--disable_tqdm", "true", "--save_strategy", "no", "--generate.prompts", "[]",
            "--parallel_mode", "data_parallel", "--data_parallel", "2", "--output_dir", str(tmp_path / "out"), *extra]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One package cache for the CLI runs: the second reads the tokenizer and data the first prepared."""
    return tmp_path_factory.mktemp("run_errors") / "cache"


def _environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "MINDFORMERS_PY_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def test_a_user_error_every_rank_meets_is_printed_once(tmp_path, cache):
    """Met at the first evaluation, after the ranks started: one line for the job (it was one per rank)."""
    out = subprocess.run(_command(tmp_path, cache, "--max_steps", "2", "--eval_strategy", "steps", "--eval_steps", "1",
                                  "--metric_for_best_model", "accuracy"),
                         capture_output=True, text=True, cwd=tmp_path, env=_environment(cache), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert sum("metric_for_best_model='accuracy' is not among the evaluation metrics" in line for line in lines) == 1
    assert not any("Traceback" in line for line in lines), out.stderr[-3000:]


def test_ctrl_c_stops_every_process_with_one_line(tmp_path, cache):
    """Ctrl-C (SIGINT to the terminal's process group) during training: the CLI prints one line, the ranks none (they
    printed pages of tracebacks, and the agent its own lines), and the run ends with status 130."""
    proc = subprocess.Popen(_command(tmp_path, cache, "--max_steps", "100000", "--eval_strategy", "no", "--logging_steps", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=_environment(cache), start_new_session=True)
    try:
        deadline = time.time() + 300
        for line in proc.stdout:  # training has started in both ranks once a step is logged
            if line.startswith("step 2:") or time.time() > deadline:
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith(("error", "[rank", "W", "E", "Traceback"))
            or "Interrupt" in line or "signal" in line]  # not the data's progress bars
    assert len(said) == 1 and said[0].startswith("error: interrupted (Ctrl-C); every process of the run was "
                                                 "stopped"), err[-3000:]
