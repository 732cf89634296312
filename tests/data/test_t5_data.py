"""The T5 data pieces: the T5-style tokenizer, span corruption (a function of seed and sample index), the stdlib
docstring dataset, and the ROUGE / BLEU modules shipped with the package."""

import pytest
import rouge_score.rouge_scorer
import sacrebleu

from mindformers_py.data.stdlib.code_summaries import function_summaries
from mindformers_py.data.span_corruption import corrupted_lengths, span_corrupt, span_corruption_dataset
from mindformers_py.data.tokenizers.t5 import sentinel_ids, train_t5_tokenizer
from mindformers_py.errors import ConfigError
from mindformers_py.metrics import load_metric, score_texts

CODE = "def add(a, b):\n    \"\"\"Return the sum.\"\"\"\n    return a + b\n\n\nclass Point:\n    x = 1\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_t5_tokenizer([CODE * 20, "the quick brown fox jumps over the lazy dog " * 30], vocab_size=400, extra_ids=20)


def test_tokenizer_has_t5s_special_ids_and_sentinels_last(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = sentinel_ids(tokenizer)
    assert len(ids) == 20 and ids[0] == len(tokenizer) - 1 and ids == sorted(ids, reverse=True)
    encoded = tokenizer(CODE).input_ids
    assert encoded[-1] == 1 and tokenizer.decode(encoded, skip_special_tokens=True) == CODE  # exact round trip
    assert tokenizer.decode([ids[0], ids[1]]) == "<extra_id_0><extra_id_1>"


def test_span_corruption_depends_only_on_seed_and_index():
    ids = list(range(100, 164))
    sentinels = list(range(999, 979, -1))
    a = span_corrupt(ids, sentinels, 1, seed=7, index=3)
    assert a == span_corrupt(ids, sentinels, 1, seed=7, index=3)
    assert a != span_corrupt(ids, sentinels, 1, seed=7, index=4) and a != span_corrupt(ids, sentinels, 1, seed=8, index=3)
    inputs, targets = a
    assert (len(inputs), len(targets)) == corrupted_lengths(64) == (64 - 10 + 3 + 1, 10 + 3 + 1)
    # Putting each target span back in place of its sentinel gives the original tokens.
    spans, current = {}, None
    for token in targets[:-1]:
        if token in sentinels:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    restored = [t for token in inputs[:-1] for t in (spans[token] if token in sentinels else [token])]
    assert restored == ids and inputs[-1] == targets[-1] == 1
    assert [t for t in targets if t in sentinels] == sentinels[:3]  # in order, <extra_id_0> first


def test_dataset_corrupts_row_i_by_seed_and_i():
    import datasets

    blocks = datasets.Dataset.from_dict({"input_ids": [list(range(10 + i, 50 + i)) for i in range(6)]})
    sentinels = list(range(999, 989, -1))
    full = span_corruption_dataset(blocks, sentinels, 1, seed=3)
    assert full[4] == span_corruption_dataset(blocks, sentinels, 1, seed=3)[4]
    assert full[4]["labels"] == list(span_corrupt(blocks[4]["input_ids"], sentinels, 1, 3, 4)[1])
    # The index is the row's place in the dataset given: recipes corrupt the whole split before any sharding.
    part = span_corruption_dataset(blocks.select([4, 5]), sentinels, 1, seed=3)
    assert part[0]["labels"] == list(span_corrupt(blocks[4]["input_ids"], sentinels, 1, 3, 0)[1])
    with pytest.raises(ConfigError, match="noise_density=1.5"):
        corrupted_lengths(10, noise_density=1.5)
    with pytest.raises(ConfigError, match="sentinel tokens"):
        span_corrupt(list(range(400)), sentinels[:2], 1, 0, 0)


def test_function_summaries_remove_the_docstring():
    rows = function_summaries('''
import os

def walk_files(root, pattern):
    """Yield the files under root whose names match pattern.

    More text.
    """
    for path in os.scandir(root):
        yield path


def tiny(x):
    """Short."""
    return x
''')
    assert rows == [{"name": "walk_files", "summary": "Yield the files under root whose names match pattern.",
                     "source": "def walk_files(root, pattern):\n    for path in os.scandir(root):\n        yield path"}]


def test_rouge_and_bleu_modules_give_the_packages_scores():
    predictions = ["return the sum of two numbers", "open a file for reading"]
    references = ["return the sum of a and b", "open the file and read it"]
    scores = score_texts(predictions, references)
    scorer = rouge_score.rouge_scorer.RougeScorer(["rougeL"])
    mean = sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / 2
    assert abs(scores["rougeL"] - mean) < 1e-9
    assert abs(scores["bleu"] - sacrebleu.corpus_bleu(predictions, [references]).score / 100) < 1e-9
    per_example = load_metric("rouge").compute(predictions=predictions, references=references, use_aggregator=False)
    assert len(per_example["rouge1"]) == 2
    with pytest.raises(ConfigError, match="metric='meteor'"):
        score_texts(predictions, references, ["meteor"])
