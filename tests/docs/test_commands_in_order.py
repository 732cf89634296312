"""Every documented command runs in the order a reader meets it.

* The README's and the getting-started page's shell commands run, in page order, after a short ``make demo`` (the
  Makefile's own command, with the flags of :data:`SHORT` appended to every run so each takes seconds, as the
  first-hour tests do), in one working directory, and each succeeds.
* On every page, no ``run`` line trains into a folder that ``make demo`` or an earlier line of the page trained,
  unless it resumes (``--resume_from_checkpoint``); README and getting-started count as one page, read in that
  order. The check reads each line's ``--output_dir`` or its recipe's.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from test_docs_code import PAGES, ROOT, _cli_args, _commands, blocks

from mindformers_py.recipes import apply_overrides, load_recipe, parse_overrides

FIRST_DAY = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
_QUIET = ["--report_to", "none", "--disable_tqdm", "true"]
SHORT = {
    "tasks/gpt/pretrain_tiny.yaml": [
        "--model.num_hidden_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "2",
        "--tokenizer.vocab_size", "300", "--data.max_files", "4", "--data.max_eval_samples", "4",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--max_steps", "2",
        "--eval_steps", "2", "--save_steps", "2", "--generate.max_new_tokens", "2", *_QUIET],
    "tasks/gpt/finetune_lora.yaml": [
        "--data.max_files", "20", "--data.max_eval_samples", "4", "--per_device_train_batch_size", "2",
        "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--generate.max_new_tokens", "2", *_QUIET],
    "tasks/vit/finetune_digits.yaml": [
        "--model.num_hidden_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "2",
        "--model.intermediate_size", "32", "--per_device_train_batch_size", "4", "--max_steps", "2",
        "--data.max_eval_samples", "8", "--per_device_eval_batch_size", "8", "--eval_steps", "2", "--save_steps", "2",
        *_QUIET],
    "run_config.yaml": ["--generate.max_new_tokens", "2", *_QUIET],
}
"""Flags appended to a documented run of each recipe (a saved ``run_config.yaml`` is already short)."""


def _makefile_demo() -> list[str]:
    """The arguments ``make demo`` gives ``python -m mindformers_py``."""
    target = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(target.strip())
    return words[words.index("mindformers_py") + 1:]


def _shortened(args: list[str]) -> list[str]:
    recipe = args[1]
    key = "run_config.yaml" if recipe.endswith("run_config.yaml") else recipe
    assert key in SHORT, f"no short flags for {recipe}: add them to SHORT"
    source = str(ROOT / recipe) if recipe.startswith("tasks/") else recipe
    return [args[0], source, *args[2:], *SHORT[key]]


def _page_commands(page: Path) -> list[tuple[str, list[str] | None]]:
    """(command line, its ``mindformers_py`` arguments or None) of each shell line of ``page``, in order."""
    found = []
    for block in blocks(page):
        if block.language in ("bash", "console"):
            found += [(command, _cli_args(command)) for command, _ in _commands(block.text)]
    return found


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    """``make demo``, short: its own command line, with the short flags."""
    from mindformers_py.cli import main

    folder = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert main(_shortened(_makefile_demo())) == 0
    assert (folder / "runs/demo/run_config.yaml").is_file() and (folder / "runs/demo/trainer_state.json").is_file()
    return folder / "runs/demo"


@pytest.mark.parametrize("page", FIRST_DAY, ids=[p.name for p in FIRST_DAY])
def test_the_first_day_commands_run_in_order_after_the_demo(page, short_demo, tmp_path, monkeypatch, capsys):
    from mindformers_py.cli import main

    shutil.copytree(short_demo, tmp_path / "runs/demo")
    monkeypatch.chdir(tmp_path)
    ran = []
    for command, args in _page_commands(page):
        if args is None:
            words = shlex.split(command, comments=True)
            assert not words or words[0] in ("make", "."), f"{page.name}: a command this test cannot run: {command}"
            continue
        if args[0] != "run":
            continue
        code = main(_shortened(args))
        assert code == 0, f"{page.name}: `{command}` failed: {capsys.readouterr().err[-2000:]}"
        ran.append(command)
    assert len(ran) >= 3, ran


def _trains(args: list[str], trained: dict[str, str]) -> tuple[str, str] | None:
    """(output folder, run mode) of a documented ``run`` line, read as the CLI reads it."""
    source = args[1]
    if (ROOT / source).is_file():
        recipe = load_recipe(ROOT / source)
    else:  # a run_config.yaml an earlier line wrote: that run's recipe, in that run's folder
        assert str(Path(source).parent) in trained, f"nothing earlier writes {source}"
        recipe = {"training": {"output_dir": str(Path(source).parent)}, "run_mode": trained[str(Path(source).parent)]}
    recipe = apply_overrides(recipe, parse_overrides(args[2:]))
    return (recipe.get("training") or {}).get("output_dir"), recipe.get("run_mode", "train")


def _sequences():
    first_day = [c for page in FIRST_DAY for c in _page_commands(page)]
    others = [(page.relative_to(ROOT).as_posix(), _page_commands(page)) for page in PAGES if page not in FIRST_DAY]
    return [("README.md + docs/getting-started.md", first_day), *[s for s in others if any(a for _, a in s[1])]]


@pytest.mark.parametrize("name, commands", _sequences(), ids=[s[0] for s in _sequences()])
def test_no_documented_run_trains_into_a_folder_that_holds_another_run(name, commands):
    demo = yaml.safe_load((ROOT / "tasks/gpt/pretrain_tiny.yaml").read_text())["training"]["output_dir"]
    trained = {demo: "train"}  # make demo's
    for command, args in commands:
        if not args or args[0] != "run":
            continue
        output_dir, run_mode = _trains(args, trained)
        if run_mode not in ("train", "finetune"):
            continue
        resumes = "--resume_from_checkpoint" in args
        assert resumes or output_dir not in trained, \
            f"{name}: `{command}` trains into {output_dir}, which an earlier run trained; give it its own --output_dir"
        trained[output_dir] = run_mode
