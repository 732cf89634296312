"""SQuAD's exact match and F1 of extracted answers (the SQuAD v1.1 evaluation), as an ``evaluate`` module that loads
offline: ``evaluate.load(mindformers_py.metrics.metric_path("squad"))``.

Answers are compared after normalisation (lower case, no punctuation, no articles a/an/the, single spaces). A
prediction's exact match is 1 when it equals any of the reference answers; its F1 is the best token-overlap F1
over them. Both are averaged over the questions and reported in percent, as the official script does.
"""

import collections
import re
import string

import datasets
import evaluate

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction: str, truth: str) -> float:
    """Harmonic mean of token precision and recall between two normalised answers."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


class Squad(evaluate.Metric):
    """``compute(predictions=[{"id", "prediction_text"}], references=[{"id", "answers": {"text": [...],
    "answer_start": [...]}}]) -> {"exact_match", "f1"}`` in percent; predictions are matched to references by
    ``id``."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="SQuAD v1.1 exact match and F1 of extractive answers.",
            citation="SQuAD: 100,000+ Questions for Machine Comprehension of Text (Rajpurkar et al., 2016).",
            inputs_description="predictions: {id, prediction_text}; references: {id, answers: {text, answer_start}}.",
            features=datasets.Features({
                "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                "references": {"id": datasets.Value("string"),
                               "answers": datasets.Sequence({"text": datasets.Value("string"),
                                                             "answer_start": datasets.Value("int32")})},
            }),
        )

    def _compute(self, predictions, references):
        predicted = {p["id"]: p["prediction_text"] for p in predictions}
        em = f1 = 0.0
        for reference in references:
            if reference["id"] not in predicted:
                raise ValueError(f"no prediction for question id {reference['id']!r}")
            truths = reference["answers"]["text"] or [""]
            answer = predicted[reference["id"]]
            em += max(exact_match(answer, t) for t in truths)
            f1 += max(token_f1(answer, t) for t in truths)
        count = max(len(references), 1)
        return {"exact_match": 100.0 * em / count, "f1": 100.0 * f1 / count}
