"""Megatron's data, both ways, against megatron-core 0.16 itself (a test dependency): a corpus written by its
IndexedDatasetBuilder reads token-identically through ours; our first 1,000 training samples equal its GPTDataset's and
BlendedDataset's (one prefix over several epochs, a weighted blend, a size-weighted blend; with and without
reset_position_ids / reset_attention_mask / eod_mask_loss) for the same seed, split and sizes; files written by
`mindformers-py preprocess` are the bytes its builder writes from Megatron's preprocess_data.py encoding, and read
back through its reader. Bad input is refused in one line."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from mindformers_py.cli import main
from mindformers_py.data.megatron.blending import blending_indices, build_megatron_datasets, mix_datasets, parse_data_path
from mindformers_py.data.megatron.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mindformers_py.data.megatron.gpt_dataset import GPTSampleOptions, document_positions, parse_split
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer
from mindformers_py.errors import ConfigError, MindFormersError

with warnings.catch_warnings():  # it warns that Transformer Engine and Apex are absent (CPU)
    warnings.simplefilter("ignore")
    megatron = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import DType
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

EOD, VOCAB, SEQ = 1, 500, 32


class _Tokenizer:
    """What megatron-core's GPTDatasetConfig reads of a tokenizer (its own need a vocabulary file)."""

    eod, vocab_size, unique_identifiers = EOD, VOCAB, {"class": "test"}

    @property
    def pad(self):
        raise AttributeError("no pad token")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora written by megatron-core's builder: short and long documents, each ending with the eod token."""
    root, rng, prefixes = tmp_path_factory.mktemp("megatron"), np.random.default_rng(0), []
    for i, (docs, low, high) in enumerate([(300, 1, 60), (120, 5, 200)]):
        prefix = str(root / f"corpus{i}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(docs):
            tokens = rng.integers(2, VOCAB, int(rng.integers(low, high)))
            tokens[-1] = EOD
            builder.add_item(torch.tensor(tokens))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return root, prefixes


def test_a_corpus_written_by_megatron_reads_token_identically(corpora):
    _, prefixes = corpora
    ours, theirs = IndexedDataset(prefixes[1]), MegatronIndexedDataset(prefixes[1])
    assert len(ours) == len(theirs) and ours.dtype == np.uint16
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert all(np.array_equal(ours[i], theirs[i]) for i in range(len(ours)))
    assert np.array_equal(ours.get(7, 3, 4), theirs.get(7, 3, 4))


BLENDS = [("one prefix, two epochs", [0], None, [1000, 40, None]),
          ("weighted blend", [0, 1], [0.3, 0.7], [1000, 40, 10]),
          ("blend by size", [0, 1], None, [1000, 40, None])]


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("name,which,weights,sizes", BLENDS, ids=[b[0] for b in BLENDS])
def test_first_1000_samples_equal_megatron_cores(corpora, tmp_path, name, which, weights, sizes, documents):
    _, prefixes = corpora
    chosen = [prefixes[i] for i in which]
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=(chosen, weights), split="90,8,2",
                              reset_position_ids=documents, reset_attention_mask=documents, eod_mask_loss=documents,
                              tokenizer=_Tokenizer(), path_to_cache=None, create_attention_mask=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = megatron.BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    data_path = chosen if weights is None else [x for pair in zip(weights, chosen) for x in pair]
    options = GPTSampleOptions(SEQ, seed=1234, eod_token_id=EOD, reset_position_ids=documents,
                               reset_attention_mask=documents, eod_mask_loss=documents)
    ours = build_megatron_datasets(data_path, "90,8,2", sizes, options, cache_dir=tmp_path)
    for split in (0, 1):
        assert len(ours[split]) == len(theirs[split])
        for i in range(min(1000, len(theirs[split]))):
            mine, reference = ours[split][i], theirs[split][i]
            assert torch.equal(mine["input_ids"], reference["tokens"]), (split, i)
            targets = reference["labels"].masked_fill(reference["loss_mask"] == 0, -100)
            assert torch.equal(mine["shift_labels"], targets), (split, i)
            assert torch.equal(mine["labels"][1:], targets[:-1])  # the same targets, transformers' convention
            if documents:
                assert torch.equal(mine["position_ids"], reference["position_ids"]), (split, i)
            else:
                assert "position_ids" not in mine
    again = build_megatron_datasets(data_path, "90,8,2", sizes, options, cache_dir=tmp_path)[0]  # from the cache
    assert all(torch.equal(again[i]["input_ids"], ours[0][i]["input_ids"]) for i in (0, 17, len(again) - 1))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(texts, vocab_size=300, save_dir=folder)
    return AutoTokenizer.from_pretrained(folder)


def test_preprocess_writes_what_megatrons_builder_writes_and_its_reader_reads(tmp_path, tokenizer, capsys):
    rows = [{"text": f"def g{i}():\n    return {i}\n" * (1 + i % 5), "title": f"g{i}"} for i in range(40)]
    rows.insert(3, {"text": "", "title": "empty"})  # an empty document: kept as a document of no sequence
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["preprocess", "--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", str(tmp_path / "out"),
                 "--json-keys", "text", "title", "--workers", "2", "--append-eod",
                 "--tokenizer", tokenizer.name_or_path]) == 0
    assert "41 documents" in capsys.readouterr().out
    # Megatron's preprocess_data.py encoding (Encoder.encode), written by its own builder
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=DType.optimal_dtype(len(tokenizer)))
    for row in rows:
        ids = tokenizer(row["text"]).input_ids
        lengths = [len(ids)] if ids else []
        if ids:
            ids, lengths = ids + [tokenizer.eos_token_id], [lengths[0] + 1]
        builder.add_document(ids, lengths)
    builder.finalize(str(tmp_path / "ref.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"out_text_document.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()
    theirs = MegatronIndexedDataset(str(tmp_path / "out_title_document"))
    assert [tokenizer.decode(theirs[i][:-1]) for i in (0, 1)] == ["g0", "g1"] and theirs[0][-1] == tokenizer.eos_token_id
    assert not list(tmp_path.glob("*.preprocess-cache"))  # the resumable shards go once the files are written


def test_preprocess_resumes_from_the_shards_it_finished(tmp_path, tokenizer):
    """A run stopped midway (here: one worker's shard fails) leaves the finished shard cached; the next run
    tokenises only the other one and writes the same files as an uninterrupted run."""
    from mindformers_py.data.megatron import preprocess as module

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"x = {i}\n"}) + "\n" for i in range(20)))
    calls = []
    real = module._encode

    def failing(batch, **kwargs):
        calls.append(len(batch["text"]))
        if "x = 19\n" in batch["text"] and (tmp_path / "fail").exists():
            raise RuntimeError("stopped")
        return real(batch, **kwargs)

    (tmp_path / "fail").touch()
    module._encode = failing
    try:
        with pytest.raises(RuntimeError):
            module.preprocess(tmp_path / "in.jsonl", tmp_path / "out", tokenizer, workers=2)
        assert len(list(tmp_path.glob("out.preprocess-cache/*/tokens_00000_of_00002.arrow"))) == 1
        (tmp_path / "fail").unlink()
        module.preprocess(tmp_path / "in.jsonl", tmp_path / "out", tokenizer, workers=2)
    finally:
        module._encode = real
    module.preprocess(tmp_path / "in.jsonl", tmp_path / "whole", tokenizer, workers=1)
    assert (tmp_path / "out_text_document.bin").read_bytes() == (tmp_path / "whole_text_document.bin").read_bytes()


def test_our_writer_round_trips_and_bad_files_are_refused_in_one_line(tmp_path):
    with IndexedDatasetWriter(tmp_path / "w", np.int32) as writer:
        writer.add_document([5, 6, 7], [2, 1])
        writer.add_document([70000])
    ours, theirs = IndexedDataset(tmp_path / "w"), MegatronIndexedDataset(str(tmp_path / "w"))
    assert [ours[i].tolist() for i in range(3)] == [theirs[i].tolist() for i in range(3)] == [[5, 6], [7], [70000]]
    assert ours.document_indices.tolist() == theirs.document_indices.tolist() == [0, 2, 3]
    with pytest.raises(MindFormersError, match="does not fit the dataset's dtype uint16"):
        with IndexedDatasetWriter(tmp_path / "small", np.uint16) as writer:
            writer.add_document([70000])
    assert not list(tmp_path.glob("small*"))  # nothing half written
    with pytest.raises(MindFormersError, match=r"prefix .*missing' has no missing.idx"):
        IndexedDataset(tmp_path / "missing")
    (tmp_path / "bad.idx").write_bytes(b"not an index at all, just bytes....")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(MindFormersError, match="is not a Megatron indexed dataset index"):
        IndexedDataset(tmp_path / "bad")
    del ours, theirs
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    with pytest.raises(MindFormersError, match="do not belong together"):
        IndexedDataset(tmp_path / "w")
    for split in ("", "1,2,3,4", "a,b"):
        with pytest.raises(ConfigError, match="data.split"):
            parse_split(split)
    with pytest.raises(ConfigError, match="weights must be positive"):
        parse_data_path([0.5, "a", -1, "b"])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path([3, "a", 1, "b"]) == (["a", "b"], [0.75, 0.25])
    with pytest.raises(ConfigError, match="reset_attention_mask=true with data.reset_position_ids=false"):
        GPTSampleOptions(8, eod_token_id=0, reset_attention_mask=True)


def test_document_positions_and_weighted_mixing_of_datasets_tables():
    assert document_positions(torch.tensor([4, 1, 5, 6, 1, 1, 7]), 1).tolist() == [0, 1, 0, 1, 2, 0, 0]
    source, within = blending_indices([0.25, 0.75], 8)
    assert source.tolist() == [1, 0, 1, 1, 0, 1, 1, 1] and within.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]
    import datasets

    a = datasets.Dataset.from_dict({"x": [0, 1]})
    b = datasets.Dataset.from_dict({"x": [10, 11, 12, 13, 14, 15]})
    mixed = mix_datasets([a, b], [0.5, 0.5])  # a's share is larger than a: its rows repeat
    assert mixed["x"] == [0, 10, 1, 11, 0, 12, 1, 13]
    with pytest.raises(ConfigError, match="one weight per data.train_files entry"):
        mix_datasets([a, b], [1.0])


def test_packed_text_blocks_carry_megatrons_document_options(tokenizer):
    import datasets

    from mindformers_py.data.packing import pack_dataset

    docs = datasets.Dataset.from_dict({"text": ["x = 1\n", "def f():\n    return 2\n", "y = 3\n" * 4]})
    eos = tokenizer.eos_token_id
    plain = pack_dataset(docs, tokenizer, 8)
    assert plain.column_names == ["input_ids", "labels"]  # the default blocks are unchanged
    both = pack_dataset(docs, tokenizer, 8, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert both.column_names == ["input_ids", "labels", "position_ids"]
    for row in both:
        ids, labels, positions = (torch.tensor(row[k]) for k in ("input_ids", "labels", "position_ids"))
        assert torch.equal(positions, document_positions(ids, eos))
        after_eod = torch.cat([torch.tensor([False]), ids[:-1] == eos])
        assert torch.equal(labels, ids.masked_fill(after_eod, -100))
    assert plain["input_ids"] == both["input_ids"]
    positions_only = pack_dataset(docs, tokenizer, 8, reset_position_ids=True)
    assert positions_only.column_names == ["input_ids", "labels", "position_ids", "attention_mask"]
    assert all(all(m == 1 for m in row["attention_mask"]) for row in positions_only)


@pytest.mark.parametrize("fused", [False, True])
def test_the_trainer_reads_megatron_samples_in_order_and_scores_every_target(corpora, tmp_path, fused):
    """shift_labels survive the Trainer's column removal and are what the loss scores (all sequence_length targets,
    the fused linear cross-entropy too); the samples are read in their shuffled order."""
    import mindformers_py as mf
    from mindformers_py.data.sft_packing import PackedRowsCollator

    _, prefixes = corpora
    options = GPTSampleOptions(SEQ, seed=3, eod_token_id=EOD, reset_position_ids=True, reset_attention_mask=True)
    train = build_megatron_datasets([prefixes[0]], "1", [None], options, splits=("train",), cache_dir=tmp_path)[0]
    seen = []

    def collate(rows):
        seen.extend(r["input_ids"] for r in rows)
        return PackedRowsCollator()(rows)

    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           max_position_embeddings=SEQ))
    batch = PackedRowsCollator()([train[i] for i in range(4)])
    with torch.no_grad():
        expected = model(**batch).loss.item()  # the model's own loss of the pre-shifted targets
    args = mf.TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=1,
                                logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                                use_cpu=True, bf16=False, fused_loss=fused, learning_rate=1e-3)
    trainer = mf.Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    trainer.train()
    assert (trainer._fused_loss is not None) == fused
    assert trainer.state.log_history[-2]["loss"] == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(a, train[i]["input_ids"]) for i, a in enumerate(seen))
