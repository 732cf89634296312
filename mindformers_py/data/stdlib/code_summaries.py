"""A code-summarisation dataset from the default corpus: each documented standard-library function's source (its
docstring removed) paired with the first line of its docstring.

The split is the corpus's: by file (:func:`~mindformers_py.data.corpus.stdlib_files`), so no function of a
validation file is seen in training. Functions whose summary line is shorter than ``min_words`` words (``"Return
x."``, ``"Helper."``) or whose source is longer than ``max_lines`` lines are left out; rows are in file order,
then source order.
"""

from __future__ import annotations

import ast

import datasets

from ..corpus import stdlib_files

MIN_WORDS = 3
"""Shortest summary line kept, in words."""
MAX_LINES = 60
"""Longest function kept, in source lines (longer ones would be mostly truncated away)."""


def function_summaries(source: str, min_words: int = MIN_WORDS, max_lines: int = MAX_LINES) -> list[dict[str, str]]:
    """``{"name", "source", "summary"}`` of every documented function (methods included) in a module's ``source``:
    the function's source with its docstring lines removed, and the docstring's first non-empty line."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    rows = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno - node.lineno + 1 > max_lines:
            continue
        summary = next((line.strip() for line in doc.splitlines() if line.strip()), "")
        if len(summary.split()) < min_words:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        docstring = node.body[0]
        kept = lines[first - 1 : docstring.lineno - 1] + lines[docstring.end_lineno : node.end_lineno]
        body = "\n".join(kept).rstrip()
        if body.count("\n") == 0:  # nothing but the signature was left
            continue
        rows.append({"name": node.name, "source": _dedent(body), "summary": summary})
    return rows


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


def stdlib_docstring_dataset(split: str = "train", max_files: int | None = None, validation_fraction: float = 0.05,
                             min_words: int = MIN_WORDS, max_lines: int = MAX_LINES) -> datasets.Dataset:
    """The summarisation rows (columns ``name``, ``source``, ``summary``) of the stdlib files of ``split``."""
    rows: list[dict[str, str]] = []
    for path in stdlib_files(split, max_files, validation_fraction):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rows += function_summaries(text, min_words, max_lines)
    columns = {key: [row[key] for row in rows] for key in ("name", "source", "summary")}
    return datasets.Dataset.from_dict(columns)
