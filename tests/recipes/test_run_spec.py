"""A recipe is resolved into a run spec before anything slow starts: a recipe that fails a check is refused before its
tokenizer is loaded, its data prepared or its model built (errors that used to surface after the tokenizer and the
data, or after the whole training run); and the ranks a multi-process run launches receive what the spec holds (the
resolved recipe and the layout), from which each resolves the same spec without planning or checking the layout
again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mindformers_py.errors import ConfigError
from mindformers_py.launcher.launch import TORCHRUN_ENV
from mindformers_py.recipes import runner
from mindformers_py.recipes.layout_handover import LAYOUT_ENV
from mindformers_py.recipes.loader import load_recipe
from mindformers_py.recipes.run_spec import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tasks" / "gpt" / "pretrain_tiny.yaml"


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return ["--model.num_hidden_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "2",
            "--output_dir", str(tmp_path / "run"), "--report_to", "none", *extra]


@pytest.fixture
def nothing_slow(monkeypatch):
    """Fail the test if the run gets as far as its first slow step (the tokenizer), or builds a model."""
    def slow(*args, **kwargs):
        raise AssertionError("the run started its slow work before refusing the recipe")

    monkeypatch.setattr(runner, "_load_processing_class", slow)
    monkeypatch.setattr("mindformers_py.auto.auto_class_for", slow)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("extra, message", [
    # a layout the model cannot hold (2 heads over 4 tensor-parallel ranks): refused once the data was prepared
    (["--parallel_mode", "semi_auto_parallel", "--model_parallel", "4"],
     r"^model_parallel=4 does not divide the model's num_attention_heads=2; choose one of: 1, 2$"),
    # a generate section naming no pipeline: refused after the whole training run, when the samples were generated
    (["--generate.pipeline", "text-generaton"], r"^generate\.pipeline='text-generaton' is not valid; choose one of: "),
], ids=["layout-the-model-cannot-hold", "unknown-generate-pipeline"])
def test_a_recipe_refused_late_before_is_refused_before_anything_slow(tmp_path, nothing_slow, extra, message):
    with pytest.raises(ConfigError, match=message):
        runner.run_recipe(load_recipe(RECIPE), _overrides(tmp_path, *extra))
    assert not (tmp_path / "run").exists()


def test_the_launched_ranks_resolve_the_spec_they_are_sent_without_checking_the_layout(tmp_path, monkeypatch):
    for name in (*TORCHRUN_ENV, LAYOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    spec = resolve_recipe(load_recipe(RECIPE), _overrides(tmp_path, "--parallel_mode", "semi_auto_parallel",
                                                          "--model_parallel", "2"))
    assert spec.world == 2 and spec.layout.tp == 2 and spec.layout_checked
    sent = {}

    # what the launcher hands the ranks: a recipe file, and the layout in the environment they take
    def launch(entry, world, resolved, environ, cwd, stdio, max_restarts=0, start_method=None):
        sent.update(recipe=load_recipe(resolved), layout=json.loads(environ[LAYOUT_ENV]), world=world, cwd=cwd)

    monkeypatch.setattr("mindformers_py.launcher.launch.launch", launch)
    runner._relaunch(spec.recipe, spec.args.output_dir, spec.world, layout=spec.layout)
    assert sent["world"] == 2 and sent["recipe"] == spec.recipe and sent["cwd"] == os.getcwd()

    # a rank: started by torchrun with the layout in its environment; it neither plans nor checks the layout
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", LAYOUT_ENV: json.dumps(sent["layout"])}.items():
        monkeypatch.setenv(name, value)

    def checked_again(*args, **kwargs):
        raise AssertionError("a rank checked the layout it was sent")

    monkeypatch.setattr("mindformers_py.parallel.config.ParallelConfig.resolve", checked_again)
    monkeypatch.setattr("mindformers_py.engine.registry.plan_layout", checked_again)
    rank_spec = resolve_recipe(sent["recipe"])
    assert rank_spec.layout == spec.layout and rank_spec.parallel == spec.parallel and not rank_spec.layout_checked
    assert (rank_spec.recipe, rank_spec.world, rank_spec.run_mode, rank_spec.task) == \
        (spec.recipe, spec.world, spec.run_mode, spec.task)
    assert rank_spec.args.to_dict() == spec.args.to_dict()
