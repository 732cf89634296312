"""Encoder task pipelines on our BERT models give transformers' pipelines' results on the same weights: fill-mask,
text-classification (single texts and pairs), token-classification with every aggregation strategy and
feature-extraction (tiny checkpoints and the real MiniLM). Bad input gets one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import mindformers_py as mf
from support.bert_models import tiny_bert_model, wordpiece_tokenizer

SENTENCES = ["the capital of france is paris.", "berlin is located on a river in germany", "who lives in rome?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    wordpiece_tokenizer(path)
    return path


def _checkpoint(folder, head, **config):
    hf = tiny_bert_model("bert", head, **config)
    out = folder / head
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            (out / name).write_bytes((folder / name).read_bytes())
    return hf, out


def _close(a, b):
    """Pipeline results equal: same structure, strings and ids; scores within 1e-5."""
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a, b)
        for key in a:
            _close(a[key], b[key])
    elif isinstance(a, (float, np.floating)):
        assert a == pytest.approx(b, abs=1e-5)
    else:
        assert a == b


def test_fill_mask_matches_transformers(folder):
    hf, path = _checkpoint(folder, "masked_lm")
    ours = mf.pipeline("fill-mask", model=path)
    theirs = transformers.pipeline("fill-mask", model=hf, tokenizer=ours.tokenizer)
    assert isinstance(ours.model, mf.BertForMaskedLM)
    texts = ["the capital of [MASK] is paris.", "[MASK] lives in [MASK]."]
    for kwargs in ({}, {"top_k": 3}, {"targets": ["paris", "rome", "london"]}):
        _close(ours(texts, **kwargs), theirs(texts, **kwargs))


def test_text_classification_matches_transformers_on_texts_and_pairs(folder):
    hf, path = _checkpoint(folder, "sequence_classification", num_labels=3,
                           id2label={0: "city", 1: "river", 2: "other"}, label2id={"city": 0, "river": 1, "other": 2})
    ours = mf.pipeline("text-classification", model=path)
    theirs = transformers.pipeline("text-classification", model=hf, tokenizer=ours.tokenizer)
    _close(ours(SENTENCES), theirs(SENTENCES))
    _close(ours(SENTENCES, top_k=None), theirs(SENTENCES, top_k=None))
    pair = {"text": "where is paris?", "text_pair": "paris is in france"}
    _close(ours(pair), theirs(pair))


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_token_classification_matches_transformers(folder, strategy):
    labels = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    hf, path = _checkpoint(folder, "token_classification", num_labels=5, id2label=dict(enumerate(labels)),
                           label2id={l: i for i, l in enumerate(labels)})
    ours = mf.pipeline("ner", model=path, aggregation_strategy=strategy)
    theirs = transformers.pipeline("token-classification", model=hf, tokenizer=ours.tokenizer,
                                   aggregation_strategy=strategy)
    _close(ours(SENTENCES), theirs(SENTENCES))


def test_a_head_the_checkpoint_lacks_is_named_in_one_warning(folder, caplog):
    """fill-mask on a checkpoint of embeddings only (as all-MiniLM-L6-v2 is) runs a random head: one line says so
    and what to do; feature-extraction on the same checkpoint is quiet."""
    _, path = _checkpoint(folder, "base")
    mf.pipeline("fill-mask", model=path)
    mf.pipeline("feature-extraction", model=path)
    said = [r.getMessage() for r in caplog.records if r.name == "mindformers_py.pipelines.base"]
    assert len(said) == 1 and said[0].startswith(f"pipeline('fill-mask') on {path}: the checkpoint has no trained head")
    assert "use pipeline('feature-extraction') for the checkpoint's embeddings" in said[0]


def test_feature_extraction_matches_transformers_on_minilm():
    ours = mf.pipeline("feature-extraction", model="sentence-transformers/all-MiniLM-L6-v2")
    hf = transformers.AutoModel.from_pretrained(ours.model.name_or_path)
    theirs = transformers.pipeline("feature-extraction", model=hf, tokenizer=ours.tokenizer)
    assert isinstance(ours.model, mf.BertModel)
    got, expected = ours(SENTENCES), theirs(SENTENCES)
    for g, e in zip(got, expected, strict=True):
        assert np.abs(np.asarray(g) - np.asarray(e)).max() <= 1e-4
    tensors = ours("one sentence", return_tensors=True)
    assert isinstance(tensors, torch.Tensor) and tensors.shape[-1] == 384


def test_long_text_pairs_are_refused_or_truncated_by_the_stated_rule(folder):
    hf, path = _checkpoint(folder, "sequence_classification", num_labels=2, max_position_embeddings=64)
    pipe = mf.pipeline("text-classification", model=path)
    long = " ".join(["paris"] * 60)
    with pytest.raises(mf.MindFormersError) as err:
        pipe({"text": long, "text_pair": long})
    assert "exceeds the model's limit of 64" in str(err.value) and "truncation=True" in str(err.value)
    assert "\n" not in str(err.value)
    # truncation=True: transformers' longest_first rule takes tokens from the longer text first
    assert pipe({"text": long, "text_pair": long}, truncation=True)["label"] in ("LABEL_0", "LABEL_1")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(folder):
    model = mf.BertForMaskedLM(mf.BertConfig(vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                             max_position_embeddings=64))
    pipe = mf.pipeline("fill-mask", model=model, tokenizer=folder)
    with pytest.raises(mf.MindFormersError) as err:
        pipe("the capital of [MASK] is paris.")
    assert "vocab_size=20" in str(err.value) and "tokenizer does not match" in str(err.value)


def test_labels_outside_num_labels_are_refused():
    model = mf.BertForSequenceClassification(mf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                           num_attention_heads=4, num_labels=3))
    with pytest.raises(mf.MindFormersError) as err:
        model(torch.randint(0, 50, (2, 6)), labels=torch.tensor([1, 5]))
    assert "label 5 is outside num_labels=3" in str(err.value)
    token_model = mf.BertForTokenClassification(model.config)
    with pytest.raises(mf.MindFormersError, match="label 7 is outside num_labels=3"):
        token_model(torch.randint(0, 50, (1, 4)), labels=torch.tensor([[0, -100, 7, 1]]))
