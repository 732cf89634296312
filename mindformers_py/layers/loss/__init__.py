"""Losses of the heads: cross entropy over tokens, choices and spans, sequence classification
(:mod:`.cross_entropy`), and the output projection fused with its cross entropy, the logits never materialised
(:mod:`.linear_cross_entropy`)."""

from .cross_entropy import (
    IGNORE_INDEX,
    PROBLEM_TYPES,
    causal_lm_loss,
    check_class_ids,
    choice_cross_entropy,
    question_answering_loss,
    resolve_problem_type,
    sequence_classification_loss,
    shift_labels,
    token_cross_entropy,
)
from .linear_cross_entropy import linear_cross_entropy

__all__ = ["IGNORE_INDEX", "PROBLEM_TYPES", "causal_lm_loss", "check_class_ids", "choice_cross_entropy",
           "linear_cross_entropy", "question_answering_loss", "resolve_problem_type", "sequence_classification_loss",
           "shift_labels", "token_cross_entropy"]
