"""Accuracy: the share of predictions equal to their references (scikit-learn's ``accuracy_score``), as an
``evaluate`` module that loads offline: ``evaluate.load(mindformers_py.metrics.metric_path("accuracy"))``."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    """``compute(predictions, references, normalize=True, sample_weight=None) -> {"accuracy": float}``."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Share of predictions equal to their references.",
            citation="",
            inputs_description="predictions and references: class ids (int), one per example.",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight))}
