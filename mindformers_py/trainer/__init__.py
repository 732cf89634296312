"""Training: ``Trainer`` and ``TrainingArguments`` with HF's API, our callbacks, optimizer and loss helpers."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["Seq2SeqTrainingArguments", "TrainingArguments"], ".arguments"),
    **dict.fromkeys(["JsonlLoggerCallback", "LossCurveCallback", "ProgressCallback", "TensorBoardCallback",
                     "default_callbacks", "plot_loss_curve"], ".callbacks"),
    "FusedCausalLMLoss": ".fused_loss",
    "linear_cross_entropy": "mindformers_py.layers.loss.linear_cross_entropy",
    "Seq2SeqTrainer": ".seq2seq",
    "Trainer": ".trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
