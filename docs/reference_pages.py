"""The parts of the documentation written from the code, so they cannot drift from it.

A page marks where one goes with ``<!-- generated: NAME -->`` on a line of its own; ``docs/hooks.py`` replaces the
marker with :data:`GENERATORS` ``[NAME]()`` when the site is built, and ``tests/docs/test_reference_pages.py``
checks the generators (every field, flag and variable present) without building the site. The notebooks become
pages the same way (:func:`notebook_page`). Nothing here is a page itself (mkdocs.yml excludes it).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any, Callable

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # 3.10: the same parser, by its older name
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal right after its annotation), by name,
    through the classes it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__ == "builtins":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
        value = value.to_dict() if hasattr(value, "to_dict") and not isinstance(value, dict) else value
    else:
        return "required"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def fields_table(cls: type, skip: tuple[str, ...] = ()) -> str:
    """A Markdown table of ``cls``'s fields: name, default, what it is (its docstring)."""
    docs = field_docs(cls)
    rows = ["| field | default | what it is |", "| --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        if field.name.startswith("_") or field.name in skip:
            continue
        rows.append(f"| `{field.name}` | {_cell(_default(field))} | {_cell(docs.get(field.name, ''))} |")
    return "\n".join(rows)


def recipe_top_level() -> str:
    from mindformers_py.recipes.sections import RUN_MODES
    from mindformers_py.task_registry import TASKS

    tasks = [t for t in TASKS.values() if t.recipe_data is not None]
    rows = ["| task | also called | model class | recipe data |", "| --- | --- | --- | --- |"]
    for task in tasks:
        aliases = ", ".join(f"`{a}`" for a in getattr(task, "aliases", ()) or ())
        rows.append(f"| `{task.name}` | {aliases} | `{task.auto_class}` | `{task.recipe_data}` |")
    modes = ", ".join(f"`{m}`" for m in RUN_MODES)
    return (f"`run_mode` is one of {modes} (default `train`). `task` is one of the tasks a recipe runs (default "
            "`causal_lm`); the others train from Python with the `Trainer`:\n\n" + "\n".join(rows))


def _section(cls_path: str, skip: tuple[str, ...] = ()) -> Callable[[], str]:
    def generate() -> str:
        module, _, name = cls_path.rpartition(".")
        cls = getattr(__import__(module, fromlist=[name]), name)
        return fields_table(cls, skip)
    return generate


def cli_reference() -> str:
    """Every command of ``mindformers-py`` with its usage, description and arguments, from the parser itself, and
    the exit codes."""
    from mindformers_py.cli import EXIT_CODES, build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    out = []
    for name, sub in commands.choices.items():
        usage = " ".join(sub.format_usage().split()).replace("usage: ", "")
        out += [f"## `{name}`", "", helps.get(name) or "", "", "```text", usage, "```", ""]
        if sub.description:
            out += [" ".join(sub.description.split()), ""]
        rows = ["| argument | default | what it is |", "| --- | --- | --- |"]
        for action in sub._actions:
            if action.dest == "help":
                continue
            names = ", ".join(action.option_strings) or action.dest
            default = "" if action.default in (None, False, [], "==SUPPRESS==") or action.required else \
                f"`{action.default}`"
            if action.required and action.option_strings:
                default = "required"
            choices = f" (one of: {', '.join(map(str, action.choices))})" if action.choices else ""
            rows.append(f"| `{names}` | {default} | {_cell((action.help or '') + choices)} |")
        out += rows + [""]
    out += ["## Exit codes", "", "| code | when |", "| --- | --- |"]
    out += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES.items()]
    return "\n".join(out)


def training_arguments_differences() -> str:
    """Where our ``TrainingArguments`` differs from transformers': defaults, accepted values, fields only one has."""
    import transformers

    from mindformers_py.trainer.arguments import OPTIMIZERS, REPORT_TARGETS, TrainingArguments

    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    docs = field_docs(TrainingArguments)
    rows = ["| field | ours | transformers' | why |", "| --- | --- | --- | --- |"]
    for name, field in ours.items():
        if name in theirs and _default(field) != _default(theirs[name]):
            rows.append(f"| `{name}` | {_cell(_default(field))} | {_cell(_default(theirs[name]))} | "
                        f"{_cell(docs.get(name, ''))} |")
    only_ours = ", ".join(f"`{n}`" for n in ours if n not in theirs)
    missing = ", ".join(f"`{n}`" for n in sorted(theirs) if n not in ours and not n.startswith("_"))
    return "\n".join([
        "Defaults that differ:", "", *rows, "",
        f"Values: `optim` takes {', '.join(f'`{o}`' for o in OPTIMIZERS)}; `report_to` takes "
        f"{', '.join(f'`{r}`' for r in REPORT_TARGETS)}, `all` and `none`.", "",
        f"Fields only ours has: {only_ours}.", "",
        f"transformers' fields this TrainingArguments does not have: {missing}."])


def requirements() -> str:
    """The supported Python, torch and transformers, from ``pyproject.toml``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    rows = ["| what | supported (pyproject.toml) |", "| --- | --- |",
            f"| Python | `{project['requires-python']}` |"]
    rows += [f"| {name} | `{deps[name]}` |" for name in ("torch", "transformers", "peft", "datasets", "accelerate")]
    extras = project["optional-dependencies"]
    rows += ["", "| extra | installs |", "| --- | --- |"]
    rows += [f"| `[{name}]` | {', '.join(f'`{d}`' for d in deps_)} |" for name, deps_ in extras.items()]
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "recipe-top-level": recipe_top_level,
    "recipe-tokenizer": _section("mindformers_py.recipes.sections.TokenizerSection"),
    "recipe-data": _section("mindformers_py.recipes.sections.DataSection"),
    "recipe-generate": _section("mindformers_py.recipes.sections.GenerateSection"),
    "recipe-parallel": _section("mindformers_py.parallel.config.ParallelConfig"),
    "recipe-recompute": _section("mindformers_py.parallel.recompute_config.RecomputeConfig"),
    "cli": cli_reference,
    "training-arguments-differences": training_arguments_differences,
    "requirements": requirements,
}


def render(markdown: str) -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` replaced by its generator's text."""
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


NOTEBOOKS = ROOT / "notebooks"


def notebook_page(path: Path) -> str:
    """A notebook as a page: its Markdown cells as they are, its code cells as Python blocks, and the text its
    cells printed when it was last saved. The test suite executes every notebook (tests/test_notebooks.py)."""
    cells = json.loads(path.read_text())["cells"]
    out = [f"<!-- {path.relative_to(ROOT)}, run by the test suite; open it in Jupyter to run it yourself -->", ""]
    for cell in cells:
        source = "".join(cell.get("source", []))
        if cell["cell_type"] == "markdown":
            out += [source, ""]
        elif cell["cell_type"] == "code" and source.strip():
            out += ["```python", source, "```", ""]
            printed = "".join("".join(o.get("text", [])) for o in cell.get("outputs", []) if o.get("name") == "stdout")
            if printed.strip():
                out += ["```text", printed.rstrip("\n"), "```", ""]
    return "\n".join(out)
