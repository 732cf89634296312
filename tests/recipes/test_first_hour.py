"""The first hour of a new user, as the README tells it: ``make demo`` writes ``runs/demo``, and the LoRA recipe
starts from there without any flag. One default location for the pretraining output, which the recipes, the
Makefile and the notebook agree on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import mindformers_py as mf
from mindformers_py.cli import main
from mindformers_py.data import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DEMO = "runs/demo"


_LORA_LINE = ["run", str(ROOT / "tasks/gpt/finetune_lora.yaml"), "--max_steps", "2", "--data.max_files", "20",
              "--data.max_eval_samples", "4", "--per_device_train_batch_size", "2", "--eval_strategy", "no",
              "--save_strategy", "no", "--report_to", "none", "--generate.max_new_tokens", "2"]


def _demo_stand_in() -> None:
    """A small stand-in for make demo's output: a tiny GPT and its tokenizer in runs/demo (of the working directory)."""
    tokenizer = train_bpe_tokenizer(["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20], 300)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(flavour="gpt2", vocab_size=len(tokenizer), hidden_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128,
                                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(DEMO)
    tokenizer.save_pretrained(DEMO)


def test_the_demo_folder_is_one_place_for_every_reader():
    pretrain = yaml.safe_load((ROOT / "tasks/gpt/pretrain_tiny.yaml").read_text())
    lora = yaml.safe_load((ROOT / "tasks/gpt/finetune_lora.yaml").read_text())
    assert pretrain["training"]["output_dir"] == DEMO == lora["model"]["name_or_path"]
    demo_target = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "tasks/gpt/pretrain_tiny.yaml" in demo_target
    assert "--output_dir" not in demo_target or f"--output_dir {DEMO}" in demo_target
    notebook = json.loads((ROOT / "notebooks/finetune_gpt.ipynb").read_text())
    assert any(f'Path("../{DEMO}")' in "".join(cell["source"]) for cell in notebook["cells"])


def test_the_lora_recipe_finds_the_demo_output_without_a_flag(tmp_path, monkeypatch, capsys):
    # A small stand-in for make demo's output (the model and tokenizer in runs/demo), then the README's LoRA line
    # from that working directory, shortened.
    monkeypatch.chdir(tmp_path)
    _demo_stand_in()
    code = main(_LORA_LINE + ["--disable_tqdm", "true"])
    assert code == 0, capsys.readouterr().err
    resolved = yaml.safe_load((tmp_path / "runs/finetune_lora/run_config.yaml").read_text())
    assert resolved["model"]["name_or_path"] == DEMO
    assert (tmp_path / "runs/finetune_lora/adapter_model.safetensors").is_file()


@pytest.fixture
def fork_server_started_elsewhere():
    """The fork server the ranks fork from, started before the test captures its output: it holds other
    descriptors than the ones the test reads (as in a program that launched before)."""
    from multiprocessing import forkserver

    from mindformers_py.launcher.launch import prepare_fork_server

    prepare_fork_server()
    forkserver.ensure_running()


def test_a_two_process_lora_run_prints_one_set_of_data_bars_and_no_warnings(fork_server_started_elsewhere, tmp_path,
                                                                             monkeypatch, capfd):
    """The LoRA recipe on two processes prints datasets' Map bars once (as many as one process prints: the
    parent's, not a set per rank; the data is prepared before the layout line), no FutureWarning and no
    sequence-length warning (the recipe cuts its sequences itself). The ranks print where the launching process
    prints now (rank 0's compile line), not where the fork server they come from was started."""
    monkeypatch.chdir(tmp_path)
    _demo_stand_in()
    capfd.readouterr()
    printed = {}
    for name, layout in (("one", []), ("two", ["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2"])):
        assert main(_LORA_LINE + ["--output_dir", f"runs/{name}"] + layout) == 0
        out, err = capfd.readouterr()
        printed[name] = (out + err).replace("\r", "\n")
    assert "2 processes (semi_auto_parallel)" in printed["two"] and "compile: off" in printed["two"]
    # each bar counted once, by its first state (0%): its 100% state is printed once or twice, as time allows
    bars = {name: re.findall(r"^Map:\s+0%", text, re.M) for name, text in printed.items()}
    assert bars["one"] and len(bars["two"]) == len(bars["one"]), bars
    for text in printed.values():
        assert "FutureWarning" not in text and "Token indices sequence length" not in text, text
