"""The shipped seqeval (span F1) and squad (exact match / F1) evaluate modules load offline and give the values their
definitions give; the token-classification compute_metrics drops ignored positions."""

from __future__ import annotations

import evaluate
import numpy as np
import pytest
from transformers import EvalPrediction

from mindformers_py.metrics import metric_path, token_classification_metrics


def test_seqeval_scores_whole_spans():
    seqeval = evaluate.load(metric_path("seqeval"))
    references = [["B-PER", "I-PER", "O", "B-LOC"], ["B-LOC", "I-LOC", "O", "O"]]
    predictions = [["B-PER", "I-PER", "O", "O"], ["B-LOC", "O", "O", "B-PER"]]
    scores = seqeval.compute(predictions=predictions, references=references)
    # 3 true spans (PER, LOC, LOC-LOC), 3 predicted (PER, LOC, PER); only the PER span matches whole
    assert scores["overall_precision"] == pytest.approx(1 / 3) and scores["overall_recall"] == pytest.approx(1 / 3)
    assert scores["overall_f1"] == pytest.approx(1 / 3) and scores["overall_accuracy"] == pytest.approx(5 / 8)
    assert scores["PER"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "number": 1}
    assert scores["LOC"]["number"] == 2 and scores["LOC"]["recall"] == 0.0


def test_squad_exact_match_and_f1():
    squad = evaluate.load(metric_path("squad"))
    references = [{"id": "1", "answers": {"text": ["the Eiffel Tower", "Eiffel tower"], "answer_start": [0, 4]}},
                  {"id": "2", "answers": {"text": ["in 1889"], "answer_start": [10]}}]
    predictions = [{"id": "1", "prediction_text": "Eiffel Tower!"}, {"id": "2", "prediction_text": "built in 1889 AD"}]
    scores = squad.compute(predictions=predictions, references=references)
    # 1: equal after normalisation; 2: 2 common tokens, precision 2/4, recall 2/2 -> F1 2/3
    assert scores["exact_match"] == pytest.approx(50.0)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)


def test_token_classification_metrics_drop_ignored_positions():
    id2label = {0: "O", 1: "B-LOC", 2: "I-LOC"}
    logits = np.zeros((1, 5, 3))
    logits[0, [0, 1, 2, 3, 4], [0, 1, 2, 0, 1]] = 1.0  # predicts O B-LOC I-LOC O B-LOC
    labels = np.array([[-100, 1, 2, 0, -100]])  # the first and last positions are ignored
    scores = token_classification_metrics(id2label)(EvalPrediction(predictions=logits, label_ids=labels))
    assert scores == {"overall_precision": 1.0, "overall_recall": 1.0, "overall_f1": 1.0, "overall_accuracy": 1.0}
