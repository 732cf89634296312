"""Evaluation metrics as ``evaluate`` modules shipped inside the package, so they load without the hub.

``evaluate.load(metric_path("accuracy"))`` works like ``evaluate.load("accuracy")`` offline; :func:`load_metric`
does that, :func:`classification_metrics` turns a task's metric names into a Trainer ``compute_metrics``
(:func:`token_classification_metrics` for token classifiers, scored with ``seqeval``), and
:func:`text_generation_metrics` does the same for generated texts (ROUGE, BLEU) scored by :func:`score_texts`.
``squad`` scores extracted answers (exact match and F1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import invalid_choice

METRICS_DIR = Path(__file__).parent
AVAILABLE = tuple(sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file()))


def metric_path(name: str) -> str:
    """The folder of the shipped evaluate module ``name`` (for ``evaluate.load``)."""
    if name not in AVAILABLE:
        raise invalid_choice("metric", name, AVAILABLE)
    return str(METRICS_DIR / name)


def load_metric(name: str, **kwargs: Any) -> Any:
    """``evaluate.load`` of the shipped module ``name`` (offline)."""
    import evaluate

    return evaluate.load(metric_path(name), **kwargs)


def classification_metrics(names: Sequence[str]) -> Callable[[Any], dict[str, float]]:
    """A Trainer ``compute_metrics`` for classifiers: the argmax of the logits against the label ids, scored by each
    metric in ``names`` (``accuracy``; ``f1`` gives macro precision, recall and F1). Ignored labels (-100) are
    dropped first."""
    modules = {name: load_metric(name) for name in names}

    def compute(prediction: Any) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predictions = np.asarray(logits).argmax(-1).reshape(-1)
        references = np.asarray(prediction.label_ids).reshape(-1)
        keep = references != -100
        out: dict[str, float] = {}
        for module in modules.values():
            out.update(module.compute(predictions=predictions[keep], references=references[keep]))
        return out

    return compute


def token_classification_metrics(id2label: dict[int, str], **seqeval_kwargs: Any) -> Callable[[Any], dict[str, float]]:
    """A Trainer ``compute_metrics`` for token classifiers: each token's argmax, named by ``id2label`` (the model
    config's), against the label ids, positions labelled -100 (padding, sub-word continuations) dropped, scored
    by the shipped ``seqeval`` module (span-level precision/recall/F1 and tag accuracy; ``seqeval_kwargs`` such as
    ``mode="strict", scheme="IOB2"`` are passed on). Returns the overall scores."""
    module = load_metric("seqeval")

    def compute(prediction: Any) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predicted = np.asarray(logits).argmax(-1)
        labels = np.asarray(prediction.label_ids)
        keep = labels != -100
        predictions = [[id2label[int(p)] for p, k in zip(row, kept) if k] for row, kept in zip(predicted, keep)]
        references = [[id2label[int(t)] for t, k in zip(row, kept) if k] for row, kept in zip(labels, keep)]
        scores = module.compute(predictions=predictions, references=references, **seqeval_kwargs)
        return {k: v for k, v in scores.items() if k.startswith("overall_")}

    return compute


TEXT_METRICS = ("rouge", "bleu")
"""Metrics of generated texts (:func:`score_texts`)."""


def score_texts(predictions: Sequence[str], references: Sequence[str], names: Sequence[str] = TEXT_METRICS,
                ) -> dict[str, float]:
    """ROUGE F-measures (``rouge1``, ``rouge2``, ``rougeL``, ``rougeLsum``) and/or corpus ``bleu`` (0-1) of
    ``predictions`` against ``references``."""
    out: dict[str, float] = {}
    for name in names:
        if name not in TEXT_METRICS:
            raise invalid_choice("metric", name, TEXT_METRICS)
        result = load_metric(name).compute(predictions=list(predictions), references=list(references))
        out.update({k: v for k, v in result.items() if k != "bleu"} if name == "rouge" else {"bleu": result["bleu"]})
    return out


def text_generation_metrics(tokenizer: Any, names: Sequence[str] = TEXT_METRICS) -> Callable[[Any], dict[str, float]]:
    """A Trainer ``compute_metrics`` for generated token ids (``Seq2SeqTrainer`` with ``predict_with_generate``):
    predictions and labels are decoded (-100 read as padding, special tokens skipped, whitespace stripped) and
    scored by :func:`score_texts`."""

    def decode(ids: Any) -> list[str]:
        ids = np.where(np.asarray(ids) == -100, tokenizer.pad_token_id, np.asarray(ids))
        return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def compute(prediction: Any) -> dict[str, float]:
        predictions = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return score_texts(decode(predictions), decode(prediction.label_ids), names)

    return compute


__all__ = ["AVAILABLE", "TEXT_METRICS", "classification_metrics", "load_metric", "metric_path", "score_texts",
           "text_generation_metrics", "token_classification_metrics"]
