"""Where pretraining text comes from: the embedded default corpus and users' own files.

The default corpus is the Python standard library source of the running interpreter
(``sysconfig.get_paths()["stdlib"]``): it is on every machine that runs this package, needs no
download, is license-clean, and is a realistic code-modelling corpus (~730 files, ~12 MB on CPython
3.11 without tests). What is included:

* every ``*.py`` file under the stdlib folder, recursively, following no symlinks;
* not ``site-packages``/``dist-packages`` (third-party code, differs per machine) nor ``__pycache__``;
* not the test suites (folders named ``test``, ``tests``, ``idle_test``) unless ``include_tests=True``:
  they are ~60% of the bytes, full of generated data and deliberately odd encodings, and make the
  corpus less like ordinary code;
* not empty files (mostly ``__init__.py``), which would only add end-of-text tokens.

Files are decoded as Python does (:func:`tokenize.open`: UTF-8 unless a coding cookie says otherwise,
newlines normalised to ``\\n``); a file that cannot be decoded is skipped.

The train/validation split is *by file* and deterministic: a file goes to validation when a SHA-256
of its path relative to the stdlib root falls below ``validation_fraction``. The split of a file never
depends on which other files exist or on ``max_files``, and it is the same on every machine with the
same stdlib layout. ``max_files`` keeps the first files in hash order, a fixed pseudo-random sample
spread over the whole library rather than one package.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import tokenize
from pathlib import Path
from typing import Mapping, Sequence, Union

import datasets

from mindformers_py.errors import ConfigError, MindFormersError, check_choice

SPLITS = ("train", "validation")
"""Names accepted for ``split``."""

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Folder names never entered when collecting the stdlib corpus."""

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
"""Folder names holding test suites, left out unless ``include_tests=True``."""

FORMAT_BY_EXTENSION = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",
    ".json": "json",
    ".jsonl": "json",
    ".jsonlines": "json",
    ".csv": "csv",
    ".tsv": "csv",
}
"""File extension -> datasets packaged loader used by :func:`load_text_files` when ``format`` is None."""

FORMATS = ("text", "json", "csv")
"""Values accepted for ``format`` in :func:`load_text_files` (datasets' packaged loaders)."""

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")

DataFiles = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def stdlib_root() -> Path:
    """The standard library source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str, validation_fraction: float = 0.05) -> str:
    """``"validation"`` or ``"train"`` for a file, from a stable hash of its relative POSIX path."""
    return "validation" if _hash_fraction(relative_path) < validation_fraction else "train"


def stdlib_files(
    split: str = "train",
    max_files: int | None = None,
    validation_fraction: float = 0.05,
    include_tests: bool = False,
) -> list[Path]:
    """The stdlib ``*.py`` files of one split, in hash order, at most ``max_files`` of them.

    See the module docstring for what is included and how the split is made.
    """
    _check_split_args(split, max_files, validation_fraction)
    root = stdlib_root()
    chosen = [
        rel
        for rel in _all_relative_paths(root, include_tests)
        if split_of(rel, validation_fraction) == split
    ]
    chosen.sort(key=lambda rel: (_hash_fraction(rel), rel))
    if max_files is not None:
        chosen = chosen[:max_files]
    return [root / rel for rel in chosen]


def stdlib_corpus(
    split: str = "train",
    max_files: int | None = None,
    validation_fraction: float = 0.05,
    include_tests: bool = False,
) -> datasets.Dataset:
    """The default corpus as a :class:`datasets.Dataset`, one row per file.

    Columns: ``text`` (the file's source) and ``path`` (relative to the stdlib root, POSIX style).

    Args:
        split: ``"train"`` or ``"validation"``.
        max_files: keep at most this many files of the split (a fixed sample); ``None`` keeps all.
        validation_fraction: share of files that go to validation, in ``[0, 1)``.
        include_tests: also include the stdlib test suites.
    """
    root = stdlib_root()
    texts: list[str] = []
    paths: list[str] = []
    for path in stdlib_files(split, max_files, validation_fraction, include_tests):
        text = _read_source(path)
        if text:
            texts.append(text)
            paths.append(path.relative_to(root).as_posix())
    features = datasets.Features({"text": datasets.Value("string"), "path": datasets.Value("string")})
    return datasets.Dataset.from_dict({"text": texts, "path": paths}, features=features)


def load_text_files(
    data_files: DataFiles | Mapping[str, DataFiles],
    format: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    **loader_kwargs,
) -> datasets.Dataset | datasets.DatasetDict:
    """Load users' own files with datasets' offline packaged loaders (``text``, ``json``, ``csv``).

    Args:
        data_files: a path or glob pattern, a list of them, or a mapping ``split -> paths``.
        format: ``"text"``, ``"json"`` or ``"csv"``; inferred from the file extension when ``None``
            (``.txt .text .md .py`` -> text, ``.json .jsonl .jsonlines`` -> json, ``.csv .tsv`` ->
            csv; compression suffixes such as ``.gz`` are looked through).
        cache_dir: datasets' cache folder for the loaded Arrow files (datasets' default when None).
        **loader_kwargs: passed to the loader, e.g. ``sample_by="document"`` for one row per text file
            (the text loader's default is one row per line), or ``field=...`` for json.

    Returns:
        A :class:`datasets.Dataset` for a path/list, a :class:`datasets.DatasetDict` for a mapping.

    Raises:
        MindFormersError: a path or pattern matches no file, or the format is unknown.
    """
    as_dict = isinstance(data_files, Mapping)
    by_split = {str(k): _as_list(v) for k, v in data_files.items()} if as_dict else {"train": _as_list(data_files)}
    patterns = [p for ps in by_split.values() for p in ps]
    if not patterns:
        raise MindFormersError("data_files is empty; give at least one file path or glob pattern")
    for pattern in patterns:
        _check_exists(pattern)
    if format is None:
        format = _infer_format(patterns)
    else:
        check_choice("format", format, FORMATS)
    if format == "csv" and "sep" not in loader_kwargs and all(_strip_compression(p).endswith(".tsv") for p in patterns):
        loader_kwargs["sep"] = "\t"
    loaded = datasets.load_dataset(
        format,
        data_files=by_split,
        cache_dir=None if cache_dir is None else str(cache_dir),
        **loader_kwargs,
    )
    return loaded if as_dict else loaded["train"]


def _check_split_args(split: str, max_files: int | None, validation_fraction: float) -> None:
    check_choice("split", split, SPLITS)
    if max_files is not None and (not isinstance(max_files, int) or max_files < 1):
        raise ConfigError(f"max_files={max_files!r} is not valid; use a positive integer or None for all files")
    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(f"validation_fraction={validation_fraction!r} is not valid; use a number in [0, 1)")


def _hash_fraction(relative_path: str) -> float:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _all_relative_paths(root: Path, include_tests: bool) -> list[str]:
    skipped = EXCLUDED_DIRS if include_tests else EXCLUDED_DIRS | TEST_DIRS
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skipped)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            if path.is_file() and path.stat().st_size > 0:
                found.append(path.relative_to(root).as_posix())
    return found


def _read_source(path: Path) -> str | None:
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _as_list(files: DataFiles) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    return [os.fspath(f) for f in files]


def _check_exists(pattern: str) -> None:
    expanded = os.path.expanduser(pattern)
    if glob.has_magic(expanded):
        if not glob.glob(expanded, recursive=True):
            raise MindFormersError(f"data file pattern {pattern!r} matches no file")
    elif not os.path.isfile(expanded):
        what = "is a folder, not a file" if os.path.isdir(expanded) else "does not exist"
        raise MindFormersError(f"data file {pattern!r} {what}")


def _strip_compression(path: str) -> str:
    lowered = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if lowered.endswith(suffix):
            return lowered[: -len(suffix)]
    return lowered


def _infer_format(patterns: list[str]) -> str:
    formats = set()
    for pattern in patterns:
        ext = os.path.splitext(_strip_compression(pattern))[1]
        if ext not in FORMAT_BY_EXTENSION:
            raise ConfigError(
                f"cannot infer the format of data file {pattern!r} from its extension {ext!r}; pass format= one of: "
                f"{', '.join(map(repr, FORMATS))} (known extensions: {' '.join(sorted(FORMAT_BY_EXTENSION))})"
            )
        formats.add(FORMAT_BY_EXTENSION[ext])
    if len(formats) > 1:
        raise MindFormersError(
            f"data files mix formats {sorted(formats)}; load each format separately or pass format= explicitly"
        )
    return formats.pop()
