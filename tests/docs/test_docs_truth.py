"""The text stays true: every repository path the pages name exists (and every ``file.py::name`` names something
in that file), and the error messages they quote are the ones the code prints, produced here from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs_code import PAGES, ROOT

PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|tasks|mindformers_py|notebooks|docs|model_cards)/[\w./-]*\w)"
                  r"(?:::(\w+))?")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_repository_path_named_exists(page):
    missing = []
    for match in PATH.finditer(page.read_text()):
        path, name = ROOT / match.group(1), match.group(2)
        if not path.exists():
            missing.append(match.group(1))
        elif name and not re.search(rf"^\s*(def|class) {name}\b", path.read_text(), re.M):
            missing.append(match.group(0))
    assert missing == [], f"{page.relative_to(ROOT)} names what the repository does not hold: {missing}"


def _pattern(quote: str) -> re.Pattern:
    """A quoted message as a pattern of the message's beginning: its numbers (and sizes) stand for any number (and
    size), ``(...)`` for any parenthesised detail and ``...`` for the rest."""
    out = ""
    for part in re.split(r"(\(\.\.\.\)|\.\.\.|-?\d+(?:\.\d+)? [KMGT]iB|-?\d+(?:\.\d+)?)", quote):
        if re.fullmatch(r"-?\d+(?:\.\d+)? [KMGT]iB", part):
            out += r"-?\d+(?:\.\d+)? [KMGT]?i?B"
        elif part == "(...)":
            out += r"\(.*?\)"
        elif part == "...":
            out += ".*"
        elif re.fullmatch(r"-?\d+(?:\.\d+)?", part or "x"):
            out += r"-?\d+(?:\.\d+)?"
        else:
            out += re.escape(part)
    return re.compile(out)


def _quotes(page: Path, marker: str) -> list[str]:
    return [q for q in re.findall(r"`([^`]+)`", page.read_text()) if marker in q]


def _damaged_checkpoint(tmp: Path) -> str:
    from mindformers_py.utils.manifest import manifest_problem, write_manifest

    folder = Path("out/checkpoint-800")
    (tmp / folder).mkdir(parents=True)
    (tmp / folder / "optimizer.pt").write_bytes(b"x" * 200)
    write_manifest(tmp / folder)
    (tmp / folder / "optimizer.pt").write_bytes(b"x" * 16)
    return manifest_problem(folder)


def _damaged_model(tmp: Path, damage) -> str:
    import mindformers_py as mf

    folder = Path("model")
    mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   max_position_embeddings=16)).save_pretrained(folder)
    damage(folder)
    with pytest.raises(mf.MindFormersError) as err:
        mf.AutoModelForCausalLM.from_pretrained(folder)
    return str(err.value).replace(f"{folder}/", "")


def _cut(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])


def _pickled(folder: Path) -> None:
    import torch

    torch.save({"w": torch.zeros(2)}, folder / "model.safetensors")


def _bad_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": ')


def _no_space(tmp: Path) -> str:
    from mindformers_py.utils.disk_space import out_of_space_error

    return str(out_of_space_error(Path("out/checkpoint-800"), 49 * 2**20))


def _rank_failed(tmp: Path) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mindformers_py.parallel.launch import _failure_summary

    failure = ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=str(tmp / "none.json"))
    return _failure_summary(ChildFailedError("mindformers_py", {1: failure}))


PRODUCERS = {
    "is damaged: ": _damaged_checkpoint,
    "model.safetensors is cut short": lambda tmp: _damaged_model(tmp, _cut),
    "is a pickle (torch.save) file": lambda tmp: _damaged_model(tmp, _pickled),
    "is not valid JSON": lambda tmp: _damaged_model(tmp, _bad_json),
    "no space left for checkpoint": _no_space,
    "of the job failed with": _rank_failed,
}
"""A marker of each kind of message the pages quote -> what makes the code print it."""


@pytest.mark.parametrize("marker", list(PRODUCERS))
def test_quoted_errors_are_what_the_code_prints(marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quotes = [q for page in PAGES for q in _quotes(page, marker)]
    assert quotes, f"no page quotes a message with {marker!r} any more: drop it from PRODUCERS"
    printed = PRODUCERS[marker](tmp_path)
    for quote in quotes:
        assert _pattern(quote).match(printed), f"quoted: {quote!r}\nprinted: {printed!r}"


def test_the_hang_message_quoted_is_the_watchdogs():
    """The watchdog's line needs a job that hangs (tests/parallel/test_faults.py makes one); here its quote is held to
    the f-strings it is printed from."""
    source = (ROOT / "mindformers_py/parallel/watchdog.py").read_text()
    quotes = _quotes(ROOT / "docs/failures.md", "did not arrive")
    assert quotes
    for quote in quotes:
        assert re.match(r"rank \d+ did not arrive: no heartbeat for [\d.]+ s \(\.\.\.\); rank \d+ waits at step \d+",
                        quote), quote
    for fragment in ('did not arrive: no heartbeat for {silent:.1f} s (stopped, frozen', '{_wait(alive)} at step'):
        assert fragment in source
