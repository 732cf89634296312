"""Tests for mindformers_py.data: stdlib corpus, BPE tokenizer, packing, collator, cached pretraining data."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from mindformers_py.data import (
    ENDOFTEXT,
    PAD,
    DataCollatorForCausalLM,
    default_pretraining_data,
    default_tokenizer,
    load_text_files,
    pack_dataset,
    split_of,
    stdlib_corpus,
    stdlib_files,
    stdlib_root,
    train_bpe_tokenizer,
)
from mindformers_py.data import pretraining as pretraining_module
from mindformers_py.data.tokenizers import bpe_wordpiece as tokenizer_module
from mindformers_py.errors import ConfigError, MindFormersError

MAX_FILES = 30
VOCAB = 512

PYTHON_SAMPLE = (
    "def greet(name: str) -> str:\n"
    "    \"\"\"Say hello.\"\"\"\n"
    "\tif name == 'wörld ✓':  # unicode, tabs and CRLF\r\n"
    "        return f\"hello, {name}!\"   \n"
    "    return ''  \n\n\n"
)


@pytest.fixture(scope="module")
def train_texts() -> list[str]:
    return list(stdlib_corpus("train", max_files=MAX_FILES)["text"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, train_texts):
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(train_texts, VOCAB, save_dir=folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


# ---------------------------------------------------------------------------------------------- corpus


def test_split_is_deterministic_disjoint_and_complete():
    train = stdlib_files("train")
    validation = stdlib_files("validation")
    assert stdlib_files("train") == train and stdlib_files("validation") == validation
    assert set(train).isdisjoint(validation)
    assert validation and len(validation) < len(train)
    root = stdlib_root()
    everything = {p for p in root.rglob("*.py") if p.stat().st_size > 0}
    assert set(train) | set(validation) <= everything
    for path in train + validation:
        rel = path.relative_to(root).as_posix()
        assert "site-packages" not in rel.split("/") and "test" not in rel.split("/")
    assert all(split_of(p.relative_to(root).as_posix()) == "validation" for p in validation)


def test_max_files_is_a_prefix_and_fraction_moves_files_only_one_way():
    assert stdlib_files("train", max_files=10) == stdlib_files("train")[:10]
    small = set(stdlib_files("validation", validation_fraction=0.05))
    large = set(stdlib_files("validation", validation_fraction=0.2))
    assert small < large  # a bigger fraction only adds validation files
    assert not set(stdlib_files("train", validation_fraction=0.2)) & large


def test_include_tests_adds_test_suites():
    with_tests = stdlib_files("train", include_tests=True)
    assert len(with_tests) > len(stdlib_files("train"))
    assert any("test" in p.relative_to(stdlib_root()).parts for p in with_tests)


def test_stdlib_corpus_rows_are_whole_files():
    ds = stdlib_corpus("validation", max_files=5)
    assert ds.column_names == ["text", "path"] and len(ds) == 5
    for row in ds:
        source = (stdlib_root() / row["path"]).read_text(encoding="utf-8")
        assert row["text"] == source.replace("\r\n", "\n")


@pytest.mark.parametrize(
    "kwargs",
    [{"split": "test"}, {"max_files": 0}, {"validation_fraction": 1.0}, {"validation_fraction": -0.1}],
)
def test_stdlib_corpus_rejects_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        stdlib_corpus(**kwargs)


# ------------------------------------------------------------------------------------------ user files


def test_load_text_files_infers_format(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["x = 1", "y = 2", "z"]))
    (tmp_path / "c.csv").write_text("text,label\nhello,1\nworld,0\n")
    (tmp_path / "d.tsv").write_text("text\tlabel\nhello\t1\n")
    assert load_text_files(tmp_path / "a.txt")["text"] == ["first line", "second line"]
    assert load_text_files(str(tmp_path / "a.txt"), sample_by="document")["text"] == ["first line\nsecond line\n"]
    assert load_text_files(str(tmp_path / "*.jsonl"))["text"] == ["x = 1", "y = 2", "z"]
    assert load_text_files(tmp_path / "c.csv")["label"] == [1, 0]
    assert load_text_files(tmp_path / "d.tsv")["label"] == [1]
    both = load_text_files({"train": str(tmp_path / "b.jsonl"), "validation": [str(tmp_path / "b.jsonl")]})
    assert set(both) == {"train", "validation"} and len(both["validation"]) == 3


def test_load_text_files_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(MindFormersError, match="nope.txt"):
        load_text_files(missing)
    with pytest.raises(MindFormersError, match=r"no_match_\*\.jsonl"):
        load_text_files(str(tmp_path / "no_match_*.jsonl"))
    odd = tmp_path / "data.parquetx"
    odd.write_text("x")
    with pytest.raises(MindFormersError, match=r"data\.parquetx.*'text', 'json', 'csv'"):
        load_text_files(odd)
    (tmp_path / "ok.txt").write_text("x\n")
    with pytest.raises(ConfigError, match=r"format='xml'.*'text', 'json', 'csv'"):
        load_text_files(tmp_path / "ok.txt", format="xml")


# ------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_python_source(tokenizer, train_texts):
    val_text = stdlib_corpus("validation", max_files=1)["text"][0]
    for text in [PYTHON_SAMPLE, val_text, train_texts[0]]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in tokenizer(PYTHON_SAMPLE)["input_ids"]


def test_tokenizer_special_tokens_and_size(tokenizer, tokenizer_dir):
    assert len(tokenizer) == VOCAB
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.unk_token == ENDOFTEXT
    assert tokenizer.pad_token == PAD and tokenizer.pad_token_id != tokenizer.eos_token_id
    # BPE merges compress held-out code: far fewer tokens than bytes.
    held_out = "".join(stdlib_corpus("validation", max_files=3)["text"])
    assert len(tokenizer(held_out)["input_ids"]) < len(held_out.encode()) / 2
    assert (tokenizer_dir / "tokenizer.json").is_file()


def test_saved_tokenizer_loads_with_autotokenizer_identically(tokenizer_dir, train_texts):
    trained = train_bpe_tokenizer(train_texts, VOCAB)
    loaded = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert loaded(PYTHON_SAMPLE)["input_ids"] == trained(PYTHON_SAMPLE)["input_ids"]
    assert loaded.eos_token_id == trained.eos_token_id and loaded.pad_token_id == trained.pad_token_id


def test_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_bpe_tokenizer(["x"], 100)


def test_default_tokenizer_is_cached(tmp_path, monkeypatch):
    first = default_tokenizer(tmp_path, vocab_size=VOCAB, max_files=MAX_FILES)
    assert len(first) == VOCAB
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("tokenizer-")

    def fail(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded, not retrained")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", fail)
    second = default_tokenizer(tmp_path, vocab_size=VOCAB, max_files=MAX_FILES)
    assert second.get_vocab() == first.get_vocab()
    with pytest.raises(AssertionError, match="retrained"):
        default_tokenizer(tmp_path, vocab_size=VOCAB + 1, max_files=MAX_FILES)  # other key -> trains


# --------------------------------------------------------------------------------------------- packing


def _stream(tokenizer, texts):
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def test_packing_gives_equal_blocks_that_concatenate_to_the_stream(tokenizer):
    ds = stdlib_corpus("train", max_files=8)
    block = 64
    packed = pack_dataset(ds, tokenizer, block)
    stream = _stream(tokenizer, ds["text"])
    assert len(packed) == len(stream) // block
    assert all(len(row) == block for row in packed["input_ids"])
    assert [t for row in packed["input_ids"] for t in row] == stream[: len(packed) * block]
    assert packed["labels"] == packed["input_ids"]
    assert tokenizer.eos_token_id in stream[: len(packed) * block]


def test_packing_in_groups_drops_each_group_tail(tokenizer):
    ds = stdlib_corpus("train", max_files=6)
    block = 50
    grouped = pack_dataset(ds, tokenizer, block, docs_per_group=2)
    expected: list[int] = []
    for start in range(0, 6, 2):
        part = _stream(tokenizer, ds["text"][start : start + 2])
        expected += part[: len(part) // block * block]
    assert [t for row in grouped["input_ids"] for t in row] == expected


def test_packing_errors(tokenizer):
    tiny = datasets.Dataset.from_dict({"text": ["x = 1"]})
    n = len(_stream(tokenizer, ["x = 1"]))
    with pytest.raises(MindFormersError, match=rf"{n} tokens.*block_size=128"):
        pack_dataset(tiny, tokenizer, 128)
    with pytest.raises(MindFormersError, match="'content'.*text"):
        pack_dataset(tiny, tokenizer, 2, text_column="content")
    with pytest.raises(ConfigError, match="block_size=0"):
        pack_dataset(tiny, tokenizer, 0)


# ------------------------------------------------------------------------------------------- collator


def test_collator_pads_and_masks_labels(tokenizer):
    collate = DataCollatorForCausalLM(tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batch = collate([{"input_ids": [5, 6, eos]}, {"input_ids": torch.tensor([7, eos, 8, 9, 10])}])
    assert batch["input_ids"].tolist() == [[5, 6, eos, pad, pad], [7, eos, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, eos, -100, -100], [7, eos, 8, 9, 10]]


def test_collator_keeps_given_labels_and_pads_them(tokenizer):
    collate = DataCollatorForCausalLM(tokenizer, pad_to_multiple_of=4)
    batch = collate(
        [
            {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
            {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([-100, 5])},
        ]
    )
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[1, 2, 3, pad], [4, 5, pad, pad]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100]]
    assert batch["labels"].dtype == torch.int64


def test_collator_keeps_eos_targets_when_pad_is_eos(tokenizer_dir):
    gpt2_style = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    gpt2_style.pad_token = gpt2_style.eos_token
    eos = gpt2_style.eos_token_id
    batch = DataCollatorForCausalLM(gpt2_style)([{"input_ids": [3, eos, 4]}, {"input_ids": [3]}])
    assert batch["labels"].tolist() == [[3, eos, 4], [3, -100, -100]]


def test_collator_needs_a_pad_token(tokenizer_dir):
    no_pad = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    no_pad.pad_token = None
    with pytest.raises(MindFormersError, match="pad_token"):
        DataCollatorForCausalLM(no_pad)


# --------------------------------------------------------------------------------- pretraining data


def test_default_pretraining_data_is_packed_and_cached(tokenizer, tmp_path, monkeypatch):
    train, validation = default_pretraining_data(tokenizer, 32, max_files=4, cache_dir=tmp_path)
    assert len(train) > 0 and len(validation) > 0
    assert all(len(r) == 32 for r in train["input_ids"][:50])
    val_stream = _stream(tokenizer, stdlib_corpus("validation", max_files=4)["text"])
    assert [t for row in validation["input_ids"] for t in row] == val_stream[: len(validation) * 32]

    def fail(*args, **kwargs):
        raise AssertionError("the cached packed data should have been loaded, not rebuilt")

    monkeypatch.setattr(pretraining_module, "pack_dataset", fail)
    train2, validation2 = default_pretraining_data(tokenizer, 32, max_files=4, cache_dir=tmp_path)
    assert train2["input_ids"] == train["input_ids"] and len(validation2) == len(validation)
    with pytest.raises(AssertionError, match="rebuilt"):
        default_pretraining_data(tokenizer, 16, max_files=4, cache_dir=tmp_path)  # other key -> builds
