"""Packed fine-tuning: first-fit decreasing places every sample once, in the first bin with room; packed rows keep
each sample's positions and never score across samples; a batch of packed rows gives the same loss and gradients as
the same samples padded (the padded path stays as the comparison); the recipe fields are checked in one line."""

from __future__ import annotations

import random

import datasets
import pytest
import torch

import mindformers_py as mf
from mindformers_py.data.collators import DataCollatorForCausalLM
from mindformers_py.data.recipe_data import causal_lm_data
from mindformers_py.data.sft_packing import PackedRowsCollator, first_fit_decreasing, pack_samples
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer
from mindformers_py.errors import ConfigError
from mindformers_py.recipes.sections import DataSection, section_from_dict


def _naive_first_fit_decreasing(lengths, capacity):
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if slot is None:
            bins.append([]), room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


def test_first_fit_decreasing_is_first_fit_decreasing():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.choice([rng.randint(1, 20), rng.randint(20, 128)]) for _ in range(rng.randint(1, 300))]
        assert first_fit_decreasing(lengths, 128) == _naive_first_fit_decreasing(lengths, 128)
    assert first_fit_decreasing([5, 3, 4, 4], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="a sample of 9 tokens does not fit a packed row of 8"):
        first_fit_decreasing([9], 8)


def _samples():
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, prompt in [(30, 10), (5, 2), (12, 4), (60, 20), (7, 3), (21, 21 - 1), (3, 1)]:
        ids = torch.randint(2, 64, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return datasets.Dataset.from_list(rows)


def test_packed_rows_keep_every_sample_its_positions_and_no_cross_sample_target():
    samples = _samples()
    packed = pack_samples(samples, 64)
    assert all(len(r) <= 64 for r in packed["input_ids"]) and len(packed) == 3
    found = []
    for ids, labels, pos in zip(packed["input_ids"], packed["labels"], packed["position_ids"]):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for s, e in zip(starts, starts[1:]):
            assert pos[s:e] == list(range(e - s)) and labels[s] == -100
            found.append((tuple(ids[s:e]), tuple(labels[s + 1:e])))
    expected = [(tuple(r["input_ids"]), tuple(r["labels"][1:])) for r in samples]
    assert sorted(found) == sorted(expected)
    chosen = samples.shuffle(seed=0).select(range(3))  # a view of the table: only its rows are packed
    assert sum(map(len, pack_samples(chosen, 64)["input_ids"])) == sum(map(len, chosen["input_ids"]))
    batch = PackedRowsCollator(pad_token_id=1)([packed[i] for i in range(len(packed))])
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention mask: it would hide the documents
    short = min(range(len(packed)), key=lambda i: len(packed[i]["input_ids"]))
    n = len(packed[short]["input_ids"])
    assert batch["labels"][short, n:].eq(-100).all() and batch["input_ids"][short, n:].eq(1).all()
    assert batch["position_ids"][short, n - 1:].diff().eq(1).all()  # padding is the last document's tail


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_packed_batch_gives_the_padded_batchs_loss_and_gradients(flavour):
    samples = _samples()
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(flavour=flavour, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=128, pad_token_id=1))

    def step(batch):
        items = int((batch["labels"][:, 1:] != -100).sum())
        loss = model(**batch, num_items_in_batch=items).loss
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    padded = DataCollatorForCausalLM(_pad_tokenizer())([{"input_ids": r["input_ids"], "labels": r["labels"]}
                                                       for r in samples])
    packed = PackedRowsCollator(pad_token_id=1)(list(pack_samples(samples, 64)))
    assert packed["input_ids"].numel() < padded["input_ids"].numel() / 2  # the point of packing
    (loss_padded, grads_padded), (loss_packed, grads_packed) = step(padded), step(packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=0, atol=1e-6)
    for a, b in zip(grads_packed, grads_padded):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _pad_tokenizer():
    """A tokenizer whose pad id is 1, for transformers' padding (its vocabulary does not matter here)."""
    texts = ["a b c"] * 10
    tok = train_bpe_tokenizer(texts, vocab_size=270)
    assert tok.pad_token_id == 1
    tok.padding_side = "right"
    return tok


def test_recipe_packs_instruction_files_and_mixes_weighted_sources(tmp_path):
    import json

    for name, n in (("a", 30), ("b", 10)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"text": f"# {name} {i}\n", "target": "x = 1\n" * (1 + i % 9)}) + "\n" for i in range(n)))
    tokenizer = train_bpe_tokenizer(["# a 1\nx = 1\n"] * 20, vocab_size=280)
    data = section_from_dict(DataSection, {"source": "files", "objective": "instructions", "packing": True,
                                           "block_size": 64, "train_files": [str(tmp_path / "a.jsonl"),
                                                                              str(tmp_path / "b.jsonl")],
                                           "train_weights": [1, 3]}, "data")
    prepared = causal_lm_data(data, tokenizer, None)
    assert isinstance(prepared.collator, PackedRowsCollator)
    rows = prepared.train
    assert set(rows.column_names) == {"input_ids", "labels", "position_ids"} and max(map(len, rows["input_ids"])) <= 64
    prompts = [tokenizer.decode(ids[s:s + 3]) for ids, pos in zip(rows["input_ids"], rows["position_ids"])
               for s, p in enumerate(pos) if p == 0]
    assert sum(p.startswith("# b") for p in prompts) == 30  # b's share: 3/4 of 40 samples, its 10 rows thrice


@pytest.mark.parametrize("fields,message", [
    ({"source": "files", "train_files": ["x"], "data_path": ["p"]}, "data.data_path is only valid with"),
    ({"source": "megatron"}, "data.data_path is required"),
    ({"packing": True}, "data.packing=true packs instruction samples"),
    ({"reset_attention_mask": True}, "needs data.reset_position_ids=true"),
    ({"source": "files", "train_files": ["x", "y"], "train_weights": [1.0]}, "one weight per data.train_files entry"),
    ({"source": "megatron", "data_path": ["p"], "objective": "instructions"}, "not valid with data.source='megatron'"),
])
def test_data_fields_are_checked_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        section_from_dict(DataSection, fields, "data")
