"""Task losses computed from logits, with HF's conventions (-100 ignored, ``num_items_in_batch`` normalisation).

Every loss here is a sum over the items it scores divided by ``num_items_in_batch`` when that is given (the items
of the whole optimizer step, over every micro-batch and data-parallel rank), else a mean over the batch's own
items, which is what the corresponding transformers loss returns. Summing micro-batch losses normalised by the
step's item count gives exactly the loss (and gradients) of one big batch, whatever the accumulation or
data-parallel split: the property the Trainer relies on. What counts as an item is the task's (see
:mod:`mindformers_py.task_registry`): label tokens for language modelling and token classification, label entries
(one per sequence, or one per label of a multi-label / multi-output row) for sequence and image classification,
sequences for question answering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of a causal LM: position t predicts ``labels[t + 1]``; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _normalise(summed: torch.Tensor, num_items_in_batch: int | torch.Tensor | None, count: torch.Tensor | int) -> torch.Tensor:
    """``summed / num_items_in_batch`` when given, else ``summed / count`` (the batch's own items)."""
    if num_items_in_batch is None:
        return summed / count
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(summed.device)
    return summed / num_items_in_batch


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None,
                        shift: bool = False, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of every position's logits (B, T, V) against ``labels`` (B, T), ``ignore_index`` (-100)
    ignored; ``shift`` scores position t against ``labels[t + 1]`` (causal LM). Masked LM, token classification and
    seq2seq use it unshifted. Logits are upcast to fp32, as transformers does."""
    targets = (shift_labels(labels, ignore_index) if shift else labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    logits, targets = _scored_rows(logits.flatten(0, -2), targets.flatten(), ignore_index)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)
    if hasattr(loss, "to_local"):
        # vocabulary-parallel logits under loss_parallel give a replicated DTensor: each rank's local value is the
        # whole loss. A plain tensor can take the losses added to it (router losses, multi-token prediction), which a
        # DTensor takes in forward but not in backward.
        loss = loss.to_local()
    return loss if num_items_in_batch is None else _normalise(loss, num_items_in_batch, 1)


def _scored_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the rows with a target, where most are ignored (masked LM labels 15% of its tokens) on the CPU: the fp32
    copy and log-softmax of the other rows' logits (and their backward) are work for nothing -- in the BERT MLM
    benchmark (30,522-word vocabulary) over a third of a bf16 step. Same loss and gradients; elsewhere (CUDA, where
    the selection would wait for the device; DTensors; mostly scored rows) the rows as given."""
    if logits.device.type != "cpu" or type(logits) is not torch.Tensor:
        return logits, targets
    index = (targets != ignore_index).nonzero().squeeze(1)
    if index.numel() * 2 > targets.numel():
        return logits, targets
    return logits.index_select(0, index), targets.index_select(0, index)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int | None = None,
                   num_items_in_batch: int | torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """Next-token cross-entropy with transformers' ``ForCausalLMLoss`` arguments and meaning (a drop-in for it):
    position t predicts ``labels[t + 1]``; given ``shift_labels`` (B, T), the targets already aligned with the
    positions (what sequence- and context-parallel data paths send: a shard cannot shift across its boundary) are
    used as they are and ``labels`` is not read. ``vocab_size`` is accepted for the signature (the logits' last
    dimension says it); other keywords are ignored, as in transformers."""
    if shift_labels is None:
        return token_cross_entropy(logits, labels, num_items_in_batch, shift=True, ignore_index=ignore_index)
    return token_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index=ignore_index)


def resolve_problem_type(config: Any, labels: torch.Tensor) -> str:
    """``config.problem_type``, inferred as transformers does when unset (and stored on the config, as it does):
    one label -> regression, integer labels -> single-label, else multi-label classification."""
    if getattr(config, "problem_type", None) is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config: Any,
                                 num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Loss of pooled logits (B, num_labels) by ``config.problem_type`` (transformers' ``ForSequenceClassificationLoss``):
    MSE for regression, cross-entropy for single-label (-100 ignored), binary cross-entropy with logits for
    multi-label. Items are label entries: one per row, or one per (row, label) for multi-label and multi-output
    regression, as transformers' Trainer counts them."""
    problem = resolve_problem_type(config, labels)
    labels = labels.to(logits.device)
    logits = logits.float()
    if problem == "regression":
        if config.num_labels == 1:
            logits, labels = logits.reshape(-1), labels.reshape(-1)
        summed = F.mse_loss(logits, labels.to(logits.dtype), reduction="sum")
        return _normalise(summed, num_items_in_batch, labels.numel())
    if problem == "single_label_classification":
        targets = labels.reshape(-1)
        check_class_ids(targets, config.num_labels, "num_labels")
        summed = F.cross_entropy(logits.reshape(-1, config.num_labels), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return _normalise(summed, num_items_in_batch, (targets != IGNORE_INDEX).sum())
    if problem == "multi_label_classification":
        summed = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum")
        return _normalise(summed, num_items_in_batch, labels.numel())
    from ...errors import invalid_choice

    raise invalid_choice("problem_type", problem, PROBLEM_TYPES)


def choice_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of one row of scores (B, choices) against the right choice's index (B,), -100 ignored:
    multiple choice and next-sentence prediction (transformers' plain ``CrossEntropyLoss``). Items are rows."""
    targets = labels.reshape(-1).to(logits.device)
    summed = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return _normalise(summed, num_items_in_batch, (targets != IGNORE_INDEX).sum())


def question_answering_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
                            end_positions: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Extractive QA: the mean of the start and end cross-entropies over the sequence positions (transformers'
    ``ForQuestionAnsweringLoss``). Positions outside the sequence are clamped to its length and ignored. Items are
    sequences: with ``num_items_in_batch`` both sums are divided by it."""
    length = start_logits.shape[1]
    start = start_positions.reshape(-1).to(start_logits.device).clamp(0, length)
    end = end_positions.reshape(-1).to(end_logits.device).clamp(0, length)
    losses = []
    for logits, target in ((start_logits, start), (end_logits, end)):
        summed = F.cross_entropy(logits.float(), target, ignore_index=length, reduction="sum")
        losses.append(_normalise(summed, num_items_in_batch, (target != length).sum()))
    return (losses[0] + losses[1]) / 2


def check_class_ids(labels: torch.Tensor, num_classes: int, field: str = "num_labels") -> None:
    """Refuse class-id labels outside ``[0, num_classes)`` (other than -100, ignored) with a one-line error naming
    ``field``, instead of a bare index error from the cross-entropy. Skipped under ``torch.compile`` (it reads
    values)."""
    if torch.compiler.is_compiling() or labels.numel() == 0 or labels.is_floating_point():
        return
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= num_classes))
    if bool(bad.any()):
        from ...errors import MindFormersError

        value = int(labels[bad][0])
        raise MindFormersError(f"label {value} is outside {field}={num_classes}: class ids must be in 0..{num_classes - 1} "
                               f"(or {IGNORE_INDEX} to ignore a position); set {field} to the number of classes")
