"""Span-level precision, recall and F1 of tagged sequences (named entities), seqeval's definition (CoNLL's): an
entity counts as found only when its type and its whole span match. An ``evaluate`` module that loads offline:
``evaluate.load(mindformers_py.metrics.metric_path("seqeval"))``."""

import datasets
import evaluate
from seqeval.metrics import accuracy_score, classification_report

SCHEMES = ("IOB1", "IOB2", "IOE1", "IOE2", "IOBES", "BILOU")


class Seqeval(evaluate.Metric):
    """``compute(predictions, references, suffix=False, scheme=None, mode=None, zero_division="warn")``: lists of
    tag sequences (``["B-PER", "I-PER", "O", ...]``) -> per entity type ``{"precision", "recall", "f1", "number"}``
    and ``overall_precision``, ``overall_recall``, ``overall_f1`` (micro over entities), ``overall_accuracy``
    (tags). ``mode="strict"`` with a ``scheme`` (IOB2, IOBES, ...) applies that scheme's rules strictly; the
    default is CoNLL's lenient chunking."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Entity-level precision, recall and F1 of sequence labelling (seqeval).",
            citation="seqeval: a Python framework for sequence labeling evaluation (Nakayama, 2018).",
            inputs_description="predictions and references: lists of tag sequences, one per sentence.",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Sequence(datasets.Value("string"))}),
        )

    def _compute(self, predictions, references, suffix=False, scheme=None, mode=None, zero_division="warn"):
        if scheme is not None:
            import seqeval.scheme

            if scheme not in SCHEMES:
                raise ValueError(f"scheme={scheme!r} is not valid; choose one of: {', '.join(SCHEMES)}")
            scheme = getattr(seqeval.scheme, scheme)
        report = classification_report(y_true=references, y_pred=predictions, suffix=suffix, output_dict=True,
                                       scheme=scheme, mode=mode, zero_division=zero_division)
        overall = report.pop("micro avg")
        for summary in ("macro avg", "weighted avg"):
            report.pop(summary, None)
        scores = {entity: {"precision": float(r["precision"]), "recall": float(r["recall"]), "f1": float(r["f1-score"]),
                           "number": int(r["support"])} for entity, r in report.items()}
        scores.update(overall_precision=float(overall["precision"]), overall_recall=float(overall["recall"]),
                      overall_f1=float(overall["f1-score"]),
                      overall_accuracy=float(accuracy_score(y_true=references, y_pred=predictions)))
        return scores
