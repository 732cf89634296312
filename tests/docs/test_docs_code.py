"""Every code block of the README, the guides (``docs/*.md``) and the model cards runs or is checked here, so the
documentation claims only what runs.

* ``python`` blocks run, in page order, in one namespace per page, in a fresh working directory (sizes in the
  pages are small for that reason). A block that cannot run says so on the line before it:
  ``<!-- not run: why -->``; such blocks stay few (:data:`MOST_NOT_RUN`).
* A block with a file title (```` ```yaml title="recipe.yaml" ````) is written to that file in the working
  directory first, so the commands and code of its page can use it.
* ``bash`` and ``console`` blocks are shell, not run: each ``mindformers-py run RECIPE FLAGS`` in them (also as
  ``python -m mindformers_py`` and under ``torchrun``) is checked by loading the recipe and applying the flags, which
  refuses unknown fields and bad values as the CLI does before anything starts. ``mindformers-py plan`` commands
  do run (they start nothing); in a ``console`` block the output shown under the command must be what it prints.
* ``yaml`` blocks must parse; ``text`` blocks are output shown for reading.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "reference").glob("*.md")),
         *sorted((ROOT / "model_cards").glob("*.md"))]
LANGUAGES = {"python", "bash", "console", "yaml", "json", "text"}
MOST_NOT_RUN = 4
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
FENCE = re.compile(r"^```(\S*)(.*)$")
TITLE = re.compile(r'title="([^"]+)"')


@dataclass
class Block:
    page: Path
    line: int
    language: str
    title: str | None
    text: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (fences at the start of a line, as every page writes them)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        title = TITLE.search(opened.group(2))
        found.append(Block(page, i + 1, opened.group(1), title.group(1) if title else None,
                           "\n".join(lines[i + 1:end]) + "\n", marker.group(1) if marker else None))
        i = end + 1
    return found


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def test_every_block_says_what_it_is_and_few_are_not_run():
    unlabelled = [b.where for p in PAGES for b in blocks(p) if b.language not in LANGUAGES]
    assert unlabelled == [], f"blocks without a known language ({', '.join(sorted(LANGUAGES))}): {unlabelled}"
    not_run = [b.where for p in PAGES for b in blocks(p) if b.not_run]
    assert len(not_run) <= MOST_NOT_RUN, f"too many blocks marked 'not run': {not_run}"
    misplaced = [b.where for p in PAGES for b in blocks(p) if b.not_run and b.language != "python"]
    assert misplaced == [], "'not run' marks python blocks only (shell blocks are never run)"


def _write_titled_files(page_blocks: list[Block], folder: Path) -> None:
    for block in page_blocks:
        if block.title:
            (folder / block.title).write_text(block.text)


PYTHON_PAGES = [p for p in PAGES if any(b.language == "python" and not b.not_run for b in blocks(p))]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_ids(PYTHON_PAGES))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    page_blocks = blocks(page)
    _write_titled_files(page_blocks, tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in page_blocks:
        if block.language != "python" or block.not_run:
            continue
        try:
            exec(compile(block.text, block.where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"the block at {block.where} failed: {type(err).__name__}: {err}") from err


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """``(command line, the output lines shown under it)`` of a shell block; continuation lines joined, ``$ ``
    prompts and comments dropped."""
    out: list[tuple[str, list[str]]] = []
    pending = ""
    prompted = any(line.startswith("$ ") for line in text.splitlines())
    for line in text.splitlines():
        if prompted and not line.startswith("$ ") and not pending:
            if out:
                out[-1][1].append(line)
            continue
        line = line[2:] if line.startswith("$ ") else line
        pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                out.append((pending.strip(), []))
            pending = ""
    return out


def _cli_args(command: str) -> list[str] | None:
    """The arguments after ``mindformers-py`` (or ``python -m mindformers_py``, or ``torchrun ... -m
    mindformers_py``), without a trailing comment; None for another program."""
    words = shlex.split(command, comments=True)
    if words[:1] == ["mindformers-py"]:
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "mindformers_py" and words[0] in ("python", "torchrun"):
            return words[i + 2:]
    return None


def _output_folders() -> set[str]:
    """Folders the recipes and the documented commands write: a saved ``runs/X/run_config.yaml`` exists after one
    of them ran."""
    folders = {yaml.safe_load(p.read_text()).get("training", {}).get("output_dir")
               for p in (ROOT / "tasks").glob("*/*.yaml")}
    for page in PAGES:
        folders |= set(re.findall(r"--output_dir (\S+)", page.read_text()))
        folders |= set(re.findall(r"output_dir: (\S+)", page.read_text()))
        folders |= set(re.findall(r'output_dir="([^"]+)"', page.read_text()))
    return {f for f in folders if f}


def _check_sections(recipe: dict) -> None:
    """What the CLI checks before anything slow: the recipe's names, its task, and the values of its parallel,
    training and peft sections."""
    from mindformers_py.adapters.config import recipe_peft_config
    from mindformers_py.parallel.config import ParallelConfig
    from mindformers_py.recipes.loader import check_recipe
    from mindformers_py.recipes.runner import recipe_task
    from mindformers_py.trainer.arguments import Seq2SeqTrainingArguments, TrainingArguments

    check_recipe(recipe, "recipe")
    task = recipe_task(recipe)
    ParallelConfig.coerce(recipe.get("parallel"), "parallel")
    arguments = Seq2SeqTrainingArguments if task.name == "seq2seq_lm" else TrainingArguments
    arguments.from_dict({**(recipe.get("training") or {}), "task": task.name})
    recipe_peft_config(recipe, task.name)


SHELL_PAGES = [p for p in PAGES if any(b.language in ("bash", "console") for b in blocks(p))]


@pytest.mark.parametrize("page", SHELL_PAGES, ids=_ids(SHELL_PAGES))
def test_shell_commands_are_valid(page, tmp_path, monkeypatch):
    from mindformers_py.cli import main
    from mindformers_py.recipes import apply_overrides, load_recipe, parse_overrides

    monkeypatch.chdir(tmp_path)
    page_blocks = blocks(page)
    _write_titled_files(page_blocks, tmp_path)
    written = _output_folders()
    for block in page_blocks:
        if block.language not in ("bash", "console"):
            continue
        for command, shown in _commands(block.text):
            args = _cli_args(command)
            if not args:
                continue
            where = f"{block.where}: {command}"
            if args[0] == "run":
                source = args[1]
                if (ROOT / source).is_file():
                    recipe = load_recipe(ROOT / source)
                elif Path(source).is_file():  # a file the page writes
                    recipe = load_recipe(source)
                else:
                    assert str(Path(source).parent) in written, f"{where}: nothing documented writes {source}"
                    continue
                try:
                    _check_sections(apply_overrides(recipe, parse_overrides(args[2:])))
                except Exception as err:
                    raise AssertionError(f"{where}: {err}") from err
            elif args[0] == "plan":
                plan = [str(ROOT / a) if a.startswith("tasks/") else a for a in args]
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    assert main(plan) == 0, where
                if block.language == "console" and shown:
                    assert printed.getvalue().rstrip("\n").splitlines() == [s.rstrip() for s in shown], where


YAML_PAGES = [p for p in PAGES if any(b.language == "yaml" for b in blocks(p))]


@pytest.mark.parametrize("page", YAML_PAGES, ids=_ids(YAML_PAGES))
def test_yaml_blocks_parse(page):
    for block in blocks(page):
        if block.language == "yaml":
            assert isinstance(yaml.safe_load(block.text), dict), block.where


def test_readme_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert missing == []
    assert len(text.splitlines()) <= 150  # a front door, not the manual


def test_no_guide_is_left_out_of_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert [p for p in pages if p not in nav] == []
    assert os.path.isdir(ROOT / "model_cards")  # the cards' one source; docs/models/ only includes them
