"""mindformers_py.pipeline("text-classification") and ("token-classification") on our GPT classifiers give what
transformers' pipelines give on transformers' own classes with the same weights."""

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer

TEXTS = ["def main(): return 0", "hello world, hello there", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(TEXTS * 10, vocab_size=300, save_dir=root)
    return root


def _checkpoint(head: str, tokenizer_dir, root):
    """An HF GPT-2 classifier (3 named labels) with the tokenizer, and the same checkpoint converted to ours."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=tokenizer.pad_token_id,
        id2label={0: "LOW", 1: "MID", 2: "HIGH"}, label2id={"LOW": 0, "MID": 1, "HIGH": 2})
    cls = transformers.GPT2ForSequenceClassification if head == "text" else transformers.GPT2ForTokenClassification
    hf = cls(config).eval()
    hf.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    mf.convert_checkpoint(root / "hf", root / "ours", to="mindformers")
    return hf, tokenizer, root / "ours"


@pytest.mark.parametrize("kwargs", [{}, {"top_k": None}, {"top_k": 2, "function_to_apply": "sigmoid"}])
def test_text_classification_equals_transformers(tokenizer_dir, tmp_path, kwargs):
    hf, tokenizer, ours_dir = _checkpoint("text", tokenizer_dir, tmp_path)
    ours = mf.pipeline("text-classification", model=ours_dir)
    assert isinstance(ours.model, mf.GPTForSequenceClassification)
    reference = transformers.pipeline("text-classification", model=hf, tokenizer=tokenizer)
    (labels, scores), (expected_labels, expected_scores) = _split(ours(TEXTS, **kwargs)), _split(reference(TEXTS, **kwargs))
    assert labels == expected_labels and scores == pytest.approx(expected_scores, abs=1e-5)


def _split(results):
    """Labels and scores, flattened."""
    flat = [r for row in results for r in (row if isinstance(row, list) else [row])]
    return [r["label"] for r in flat], [r["score"] for r in flat]


@pytest.mark.parametrize("strategy", ["none", "simple", "first"])
def test_token_classification_equals_transformers(tokenizer_dir, tmp_path, strategy):
    hf, tokenizer, ours_dir = _checkpoint("token", tokenizer_dir, tmp_path)
    ours = mf.pipeline("token-classification", model=ours_dir, aggregation_strategy=strategy)
    assert isinstance(ours.model, mf.GPTForTokenClassification)
    reference = transformers.pipeline("token-classification", model=hf, tokenizer=tokenizer, aggregation_strategy=strategy)
    got, expected = ours(TEXTS), reference(TEXTS)
    assert got and [[{k: v for k, v in e.items() if k != "score"} for e in row] for row in got] == \
        [[{k: v for k, v in e.items() if k != "score"} for e in row] for row in expected]
    assert [float(e["score"]) for row in got for e in row] == \
        pytest.approx([float(e["score"]) for row in expected for e in row], abs=1e-5)
