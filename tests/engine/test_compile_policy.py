"""``torch_compile="auto"`` (the default): each layer compiled when training on a CUDA GPU, where it was measured
faster and leaner than the eager step, not on the CPU (slower there) nor under context parallelism or
``auto_parallel`` (whose planner may choose it); the arguments hold the resolved bool and write "auto" back, as
``bf16="auto"`` does, and recipes and the CLI spell it the same way."""

import pytest
import torch

import mindformers_py as mf
from mindformers_py.engine.compile_policy import resolve_torch_compile
from mindformers_py.errors import ConfigError


@pytest.fixture
def cuda_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def args(**fields) -> mf.TrainingArguments:
    return mf.TrainingArguments(output_dir="unused", bf16=False, **fields)


def test_auto_is_off_on_the_cpu_and_written_back():
    resolved = args(use_cpu=True)
    assert resolved.torch_compile is False and resolved.to_dict()["torch_compile"] == "auto"
    assert mf.TrainingArguments.from_dict(resolved.to_dict()) == resolved
    assert args(use_cpu=True, torch_compile=False).to_dict()["torch_compile"] is False


def test_auto_is_on_for_cuda_training(cuda_visible):
    resolved = args()
    assert resolved.torch_compile is True and resolved.to_dict()["torch_compile"] == "auto"
    assert args(use_cpu=True).torch_compile is False  # the CPU asked for on a GPU machine
    assert args(torch_compile=False).torch_compile is False


@pytest.mark.parametrize("layout", [dict(parallel_mode="semi_auto_parallel", context_parallel=2),
                                    dict(parallel_mode="auto_parallel")])
def test_auto_is_off_where_the_layout_may_refuse_compiled_layers(cuda_visible, layout):
    assert args(parallel_config=layout).torch_compile is False
    assert resolve_torch_compile("auto", use_cpu=False, parallel_config=mf.ParallelConfig(**layout)) is False
    assert resolve_torch_compile("auto", use_cpu=False, parallel_config=mf.ParallelConfig(
        parallel_mode="data_parallel", data_parallel=2)) is True


def test_a_backend_turns_it_on_and_is_saved_as_asked():
    resolved = args(use_cpu=True, torch_compile_backend="eager")
    assert resolved.torch_compile is True and resolved.to_dict()["torch_compile"] is True  # not what "auto" gave


def test_recipe_and_cli_spellings_and_a_clear_error():
    assert mf.TrainingArguments.from_dict({"output_dir": "x", "use_cpu": "true", "torch_compile": " AUTO "}).torch_compile is False
    assert mf.TrainingArguments.from_dict({"output_dir": "x", "torch_compile": "true"}).torch_compile is True
    with pytest.raises(ConfigError, match=r"torch_compile='sometimes' is not valid; expected true, false or 'auto'"):
        mf.TrainingArguments(output_dir="unused", torch_compile="sometimes")
