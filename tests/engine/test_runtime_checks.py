"""Options that would do nothing are refused or honoured: selective recompute of parts a layer does not have,
torch_compile_mode under the pipeline engine; the package data pyproject.toml names exists."""

from __future__ import annotations

import glob
import tomllib
from pathlib import Path

import pytest
from torch import nn

import mindformers_py as mf
from mindformers_py.engine import PipeliningEngine
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import RecomputeConfig
from mindformers_py.parallel.recompute import apply_recompute

ROOT = Path(__file__).resolve().parents[2]


class OtherBlock(nn.Module):
    """A layer whose attention is not our Attention class (as a third-party model's would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.mlp = nn.Linear(8, 8)


class OtherModel(nn.Module):
    _no_split_modules = ["OtherBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([OtherBlock(), OtherBlock()])


def test_selective_recompute_refuses_what_a_layer_does_not_have():
    with pytest.raises(ConfigError, match=r"select_recompute='attention_core' is not valid for OtherBlock.*'mlp'"):
        apply_recompute(OtherModel(), RecomputeConfig(recompute="selective", select_recompute=["attention_core"]))
    with pytest.raises(ConfigError, match=r"select_recompute='self_attn' is not valid for OtherBlock.*attn, mlp"):
        apply_recompute(OtherModel(), RecomputeConfig(recompute="selective", select_recompute=["self_attn"]))
    model = OtherModel()
    apply_recompute(model, RecomputeConfig(recompute="selective", select_recompute=["mlp"]))
    assert type(model.layers[0].mlp).__name__ == "CheckpointWrapper"


def test_selective_recompute_of_our_attention_core_applies():
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2))
    apply_recompute(model, RecomputeConfig(recompute="selective", select_recompute=["attention_core"]))
    assert all(layer.self_attn.core is not type(layer.self_attn).core for layer in model.model.layers)


def test_pipeline_stages_are_compiled_with_the_requested_mode(monkeypatch):
    calls = []
    monkeypatch.setattr("mindformers_py.engine.distributed.parallelize", lambda *a, **k: calls.append(k))
    args = mf.TrainingArguments(output_dir="unused", torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs")
    engine = PipeliningEngine(mf.ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2,
                                              micro_batch_num=2).resolve(2), args)
    engine.parallelize(nn.Linear(2, 2), stage=1)
    assert calls[0]["compile_layers"] and calls[0]["compile_mode"] == "max-autotune-no-cudagraphs" and calls[0]["stage"] == 1


def test_package_data_globs_name_existing_files():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, patterns in config["tool"]["setuptools"]["package-data"].items():
        for pattern in patterns:
            assert glob.glob(str(ROOT / package / pattern), recursive=True), f"{package}/{pattern} matches nothing"


def test_cli_docstring_names_only_existing_commands():
    from mindformers_py import cli

    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    first_line = cli.__doc__.splitlines()[0]
    named = {word.strip("`,.") for word in first_line.split("``")[1::2]} - {"mindformers-py"}
    assert named == commands, (named, commands)
