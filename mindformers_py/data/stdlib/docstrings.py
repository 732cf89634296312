"""A text-classification task built from data on every machine: which standard-library package a function's
docstring comes from.

Every function and method with a docstring in the running interpreter's standard library packages (folders with
an ``__init__.py``; test suites excluded, as in the default corpus) is one example: its docstring is the text, its
top-level package (``asyncio``, ``email``, ``tkinter``, ...) the label. The ``num_packages`` packages with the most
documented functions are kept. The split is **by file**, so no file is in both splits: within each package the
files are taken in a fixed hash order and go to validation until it holds ``validation_share`` of the package's
examples (at least one file), the rest to training. Every class is therefore in both splits, and a file's
neighbouring functions cannot leak its answers into the held-out split.
"""

from __future__ import annotations

import ast
import collections
import hashlib
import os
import platform
import tokenize
from pathlib import Path

import datasets

from ...errors import ConfigError
from ..cache import atomic_dir, fingerprint, resolve_cache_dir
from ..corpus import stdlib_files, stdlib_root

_CACHE_FORMAT = 1  # bump when the extraction rules change so old cache entries are not reused


def _documented_functions(path: Path) -> list[str]:
    """The docstrings of every function and method in one source file (none when it does not parse)."""
    try:
        with tokenize.open(path) as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, LookupError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                docs.append(doc.strip())
    return docs


def stdlib_docstrings(num_packages: int = 10, validation_share: float = 0.2,
                      cache_dir: str | os.PathLike[str] | None = None) -> datasets.DatasetDict:
    """``train`` and ``validation`` splits with columns ``text`` (a docstring), ``label`` (its package) and
    ``path`` (its file, relative to the stdlib folder); see the module docstring for the rules. Built once per
    stdlib (a fingerprint of its file list) and cached on disk."""
    if not isinstance(num_packages, int) or num_packages < 2:
        raise ConfigError(f"num_packages={num_packages!r} is not valid; use an integer >= 2")
    if not 0.0 < validation_share < 1.0:
        raise ConfigError(f"validation_share={validation_share!r} is not valid; use a number in (0, 1)")
    root = stdlib_root()
    files = [(p.relative_to(root).as_posix(), p.stat().st_size) for p in stdlib_files("train", validation_fraction=0.0)]
    key = fingerprint(_CACHE_FORMAT, platform.python_implementation(), platform.python_version(), datasets.__version__,
                      num_packages, validation_share, files)
    folder = resolve_cache_dir(cache_dir) / f"docstrings-{key}"
    if not (folder / "dataset_dict.json").is_file():
        with atomic_dir(folder) as tmp:
            _build(num_packages, validation_share).save_to_disk(os.fspath(tmp))
    return datasets.load_from_disk(os.fspath(folder))


def _build(num_packages: int, validation_share: float) -> datasets.DatasetDict:
    root = stdlib_root()
    by_package: dict[str, dict[str, list[str]]] = collections.defaultdict(dict)
    # validation_fraction=0.0: every file of the corpus, whatever the pretraining split says
    for path in stdlib_files("train", validation_fraction=0.0):
        relative = path.relative_to(root).as_posix()
        if "/" not in relative:  # a single-module file, not a package: it could not be split by file
            continue
        docs = _documented_functions(path)
        if docs:
            by_package[relative.split("/", 1)[0]][relative] = docs
    counts = collections.Counter({package: sum(map(len, files.values())) for package, files in by_package.items()})
    chosen = sorted(package for package, _ in counts.most_common(num_packages))
    rows: dict[str, dict[str, list[str]]] = {split: {"text": [], "label": [], "path": []} for split in ("train", "validation")}
    for package in chosen:
        files = sorted(by_package[package], key=lambda rel: hashlib.sha256(rel.encode()).hexdigest())
        held = 0
        for i, relative in enumerate(files):
            # validation until it holds its share; the last file always trains, so both splits have the package
            split = "validation" if held < validation_share * counts[package] and i < len(files) - 1 else "train"
            held += len(by_package[package][relative]) if split == "validation" else 0
            for doc in by_package[package][relative]:
                rows[split]["text"].append(doc)
                rows[split]["label"].append(package)
                rows[split]["path"].append(relative)
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("string"),
                                  "path": datasets.Value("string")})
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(columns, features=features)
                                 for split, columns in rows.items()})
