"""The pages written from the code (docs/reference_pages.py, run by the site's hook) hold every field, flag, exit code
and task; the pages written by hand that the code can check (environment variables, the version, the licence, the
notebooks, the MindFormers r2.0 names) agree with it."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest
import yaml
from test_docs_code import ROOT, blocks

from mindformers_py.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # 3.10: the same parser, by its older name
    import tomli as tomllib


def _reference_pages():
    spec = importlib.util.spec_from_file_location("reference_pages", ROOT / "docs" / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pages = _reference_pages()
DOCS = sorted((ROOT / "docs").rglob("*.md"))


def test_every_marker_has_a_generator_and_every_generator_a_page():
    used = {name for page in DOCS for name in pages.MARKER.findall(page.read_text())}
    assert used == set(pages.GENERATORS)
    for page in DOCS:
        assert not pages.MARKER.search(pages.render(page.read_text())), page


@pytest.mark.parametrize("name, cls", [
    ("recipe-tokenizer", "mindformers_py.recipes.sections.TokenizerSection"),
    ("recipe-data", "mindformers_py.recipes.sections.DataSection"),
    ("recipe-generate", "mindformers_py.recipes.sections.GenerateSection"),
    ("recipe-parallel", "mindformers_py.parallel.config.ParallelConfig"),
    ("recipe-recompute", "mindformers_py.parallel.recompute_config.RecomputeConfig"),
])
def test_the_recipe_reference_documents_every_field(name, cls):
    module, _, attr = cls.rpartition(".")
    klass = getattr(__import__(module, fromlist=[attr]), attr)
    text = pages.GENERATORS[name]()
    docs = pages.field_docs(klass)
    for field in dataclasses.fields(klass):
        assert f"| `{field.name}` |" in text, field.name
        assert docs.get(field.name), f"{klass.__name__}.{field.name} has no docstring for the reference"


def test_the_recipe_reference_names_every_task_a_recipe_runs():
    from mindformers_py.task_registry import TASKS

    text = pages.recipe_top_level()
    assert all(f"| `{t.name}` |" in text for t in TASKS.values() if t.recipe_data)


def test_the_cli_reference_documents_every_command_flag_and_exit_code():
    from mindformers_py.cli import EXIT_CODES, build_parser

    text = pages.cli_reference()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in commands.choices.items():
        assert f"## `{name}`" in text
        for action in sub._actions:
            for option in action.option_strings:
                assert option in text or option in ("-h", "--help"), (name, option)
    for code in EXIT_CODES:
        assert f"| {code} |" in text


def test_the_environment_page_names_every_variable_the_code_reads():
    source = "\n".join(p.read_text() for p in (ROOT / "mindformers_py").rglob("*.py"))
    read = set(re.findall(r"environ(?:\.get)?\(?\[?\"([A-Z][A-Z0-9_]+)\"", source))
    read |= set(re.findall(r"_ENV = \"([A-Z][A-Z0-9_]+)\"", source))
    page = (ROOT / "docs/environment.md").read_text()
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert read and missing == []


def test_the_version_moves_with_the_changelog_and_the_licence_is_there():
    import mindformers_py

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    latest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert project["version"] == mindformers_py.__version__ == latest
    assert project["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n                           Version 2.0")


def test_the_site_shows_the_notebooks_and_starts_with_the_first_day():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"]
    flat = [next(iter(entry.values())) for section in nav for entry in
            (section.get(next(iter(section))) if isinstance(next(iter(section.values())), list) else [section])]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{notebook.stem}.md" in flat
        page = pages.notebook_page(notebook)
        assert "```python" in page and str(notebook.relative_to(ROOT)) in page
    assert flat.index("installation.md") < flat.index("getting-started.md") < flat.index("hf-habits.md") \
        < flat.index("training.md")
    features = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["theme"]["features"]
    assert "navigation.footer" in features  # previous / next on every page


def test_mindformers_r2_parallelism_names_are_read(tmp_path):
    from mindformers_py.parallel.config import ParallelConfig
    from mindformers_py.recipes import load_recipe

    block = next(b for b in blocks(ROOT / "docs/coming-from.md") if b.title == "r2_parallelism.yaml")
    (tmp_path / "r2.yaml").write_text(block.text)
    recipe = load_recipe(tmp_path / "r2.yaml")
    assert "parallelism" not in recipe
    config = ParallelConfig.coerce(recipe["parallel"], "parallel")
    assert (config.parallel_mode, config.data_parallel, config.zero_stage) == ("semi_auto_parallel", 2, 3)
    r2 = {"tensor_parallel": 2, "pipeline_parallel": 2, "context_parallel": 1, "expert_parallel": 1}
    (tmp_path / "tp.yaml").write_text(yaml.safe_dump({"parallelism": r2, "parallel": {"micro_batch_num": 2}}))
    config = ParallelConfig.coerce(load_recipe(tmp_path / "tp.yaml")["parallel"], "parallel")
    assert (config.model_parallel, config.pipeline_stage, config.zero_stage) == (2, 2, 0)
    for bad, message in ((dict(data_parallel_shard=-1), "give the number"), (dict(warp=2), "not one of MindFormers"),
                         (dict(tensor_parallel=2), "contradicts parallel.model_parallel=4")):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"parallelism": bad, "parallel": {"model_parallel": 4}}))
        with pytest.raises(ConfigError, match=message):
            load_recipe(tmp_path / "bad.yaml")


@pytest.mark.parametrize("page", ["docs/reference/recipe.md", "docs/coming-from.md"])
def test_the_recipes_the_pages_show_are_valid(page, tmp_path):
    from test_docs_code import _check_sections

    from mindformers_py.recipes import load_recipe

    shown = [b for b in blocks(ROOT / page) if b.language == "yaml" and b.title]
    assert shown
    for block in shown:
        (tmp_path / block.title).write_text(block.text)
        _check_sections(load_recipe(tmp_path / block.title))
