"""The text stays true: every repository path the pages name exists (and every ``file.py::name`` names something
in that file), and the error messages they quote are the ones the code prints, produced here from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs_code import PAGES, ROOT, blocks

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
    """The quotes of ``page`` holding ``marker``: inline code, and the lines of ``text`` blocks (output shown)."""
    text = page.read_text()
    shown = [line for block in blocks(page) if block.language == "text" for line in block.text.splitlines()]
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    return [q for q in inline + shown if marker in q]


def _damaged_checkpoint(tmp: Path) -> str:
    from mindformers_py.checkpoint.manifest import manifest_problem, write_manifest

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
    from mindformers_py.checkpoint.disk_space import out_of_space_error

    return str(out_of_space_error(Path("out/checkpoint-800"), 49 * 2**20))


def _rank_failed(tmp: Path) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mindformers_py.launcher.launch import _failure_summary

    failure = ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=str(tmp / "none.json"))
    return _failure_summary(ChildFailedError("mindformers_py", {1: failure}))


def _hub_id_missing(tmp: Path, quote: str) -> str:
    import mindformers_py as mf

    name = re.match(r"'([^']+)'", quote).group(1)
    with pytest.raises(mf.MindFormersError) as err:
        mf.AutoModelForCausalLM.from_pretrained(name)
    return str(err.value)


def _another_run(tmp: Path) -> str:
    from mindformers_py.trainer.checkpoint import check_output_dir

    (tmp / "runs/demo/checkpoint-800").mkdir(parents=True)
    with pytest.raises(Exception) as err:
        check_output_dir("runs/demo", overwrite=False)
    return str(err.value)


PRODUCERS = {
    "is no local folder, no preset": _hub_id_missing,
    "holds another run": _another_run,
    "is damaged: ": _damaged_checkpoint,
    "model.safetensors is cut short": lambda tmp: _damaged_model(tmp, _cut),
    "is a pickle (torch.save) file": lambda tmp: _damaged_model(tmp, _pickled),
    "is not valid JSON": lambda tmp: _damaged_model(tmp, _bad_json),
    "no space left for checkpoint": _no_space,
    "of the job failed with": _rank_failed,
}
"""A marker of each kind of message the pages quote -> what makes the code print it."""


ALL_PAGES = [*PAGES, *sorted((ROOT / "docs").glob("*/*.md"))]


@pytest.mark.parametrize("marker", list(PRODUCERS))
def test_quoted_errors_are_what_the_code_prints(marker, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quotes = [q for page in ALL_PAGES for q in _quotes(page, marker)]
    assert quotes, f"no page quotes a message with {marker!r} any more: drop it from PRODUCERS"
    produce = PRODUCERS[marker]
    for quote in quotes:
        printed = produce(tmp_path, quote) if produce.__code__.co_argcount == 2 else produce(tmp_path)
        assert _pattern(quote).match(printed), f"quoted: {quote!r}\nprinted: {printed!r}"


def test_the_hang_message_quoted_is_the_watchdogs():
    """The watchdog's line needs a job that hangs (tests/launcher/test_faults.py makes one); here its quote is held to
    the f-strings it is printed from."""
    source = (ROOT / "mindformers_py/launcher/watchdog.py").read_text()
    quotes = _quotes(ROOT / "docs/failures.md", "did not arrive")
    assert quotes
    for quote in quotes:
        assert re.match(r"rank \d+ did not arrive: no heartbeat for [\d.]+ s \(\.\.\.\); rank \d+ waits at step \d+",
                        quote), quote
    for fragment in ('did not arrive: no heartbeat for {silent:.1f} s (stopped, frozen', '{_wait(alive)} at step'):
        assert fragment in source


def test_the_performance_page_says_what_make_bench_runs():
    target = re.search(r"^bench:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    in_make = list(dict.fromkeys(re.findall(r"benchmarks/(\w+\.py)", target)))
    page = (ROOT / "docs/performance.md").read_text()
    said = re.search(r"`make bench` runs, one after the other: (.+?)\. The others", page, re.S).group(1)
    assert list(dict.fromkeys(re.findall(r"`(\w+\.py)", said))) == in_make
    helpers = {"family_models.py", "flops.py"}  # imported by the benchmarks, not run
    unnamed = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in helpers and p.name not in page]
    assert unnamed == [], f"benchmarks the performance page does not mention: {unnamed}"
