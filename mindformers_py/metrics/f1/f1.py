"""Precision, recall and F1 over class ids (scikit-learn's ``precision_recall_fscore_support``), as an
``evaluate`` module that loads offline: ``evaluate.load(mindformers_py.metrics.metric_path("f1"))``."""

import datasets
import evaluate
from sklearn.metrics import precision_recall_fscore_support


class F1(evaluate.Metric):
    """``compute(predictions, references, average="macro", labels=None) -> {"precision", "recall", "f1"}``;
    ``average`` is scikit-learn's: ``"macro"``, ``"micro"``, ``"weighted"`` or ``"binary"`` (with ``pos_label``)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Precision, recall and F1 of class predictions.",
            citation="",
            inputs_description="predictions and references: class ids (int), one per example.",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro", labels=None, pos_label=1):
        precision, recall, f1, _ = precision_recall_fscore_support(
            references, predictions, average=average, labels=labels, pos_label=pos_label, zero_division=0)
        return {"precision": float(precision), "recall": float(recall), "f1": float(f1)}
