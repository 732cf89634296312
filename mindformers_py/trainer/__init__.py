"""Training: ``Trainer`` and ``TrainingArguments`` with HF's API, our callbacks, optimizer and loss helpers."""

from .arguments import TrainingArguments
from .callbacks import (
    JsonlLoggerCallback,
    LossCurveCallback,
    ProgressCallback,
    TensorBoardCallback,
    default_callbacks,
    plot_loss_curve,
)
from ..layers.linear_cross_entropy import linear_cross_entropy
from .fused_loss import FusedCausalLMLoss
from .seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from .trainer import Trainer

__all__ = [
    "FusedCausalLMLoss",
    "JsonlLoggerCallback",
    "LossCurveCallback",
    "ProgressCallback",
    "TensorBoardCallback",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "default_callbacks",
    "linear_cross_entropy",
    "plot_loss_curve",
]
