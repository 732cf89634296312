"""``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments``: transformers' names for training encoder-decoders with
generation during evaluation.

With ``predict_with_generate=True``, ``evaluate`` and ``predict`` compute the loss as usual and, as predictions,
the token ids the model's ``generate`` produces for each batch's source (``generation_max_length`` /
``generation_num_beams``, or the keyword arguments given to ``evaluate``/``predict``, else the model's generation
config), so ``compute_metrics`` scores texts (:func:`~mindformers_py.metrics.text_generation_metrics`: ROUGE, BLEU).
Ranks holding shards of the model (ZeRO-2/3) generate in step (``synced_gpus``); pipeline layouts, whose ranks
hold parts of the model, cannot generate and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .arguments import Seq2SeqTrainingArguments, TrainingArguments  # noqa: F401 (transformers' module has both)
from .trainer import Trainer

# Batch keys of the target side: generation starts from the decoder start token, not from them.
_TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def check_generation_layout(args: Any, layout: Any) -> None:
    """Refuse ``predict_with_generate`` under a layout with pipeline stages (each rank holds part of the model, so
    none can generate), before training starts rather than at the first evaluation."""
    if getattr(args, "predict_with_generate", False) and getattr(layout, "pp", 1) > 1:
        raise ConfigError(f"predict_with_generate=True is not supported with pipeline_stage={layout.pp} (each rank "
                          "holds part of the model, so none can generate); set predict_with_generate=False (the "
                          "evaluation then scores the loss), or train without pipeline stages")


class Seq2SeqTrainer(Trainer):
    """:class:`Trainer` whose evaluation can generate (``args.predict_with_generate``); ``evaluate`` and ``predict``
    also take ``generate``'s keyword arguments (``max_new_tokens``, ``num_beams``, ...), as transformers' does.
    Generation under a layout with pipeline stages is refused when the Trainer is made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_generation_layout(self.args, self._workers.layout if self._workers is not None
                                else self.engine.layout)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict[str, float]:
        self._gen_kwargs = gen_kwargs
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                **gen_kwargs: Any):
        self._gen_kwargs = gen_kwargs
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, num_items_in_batch: Any = None):
        """``(loss, generated token ids, labels)`` with ``predict_with_generate``; else the Trainer's."""
        generate = getattr(self.args, "predict_with_generate", False)
        if not generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, num_items_in_batch)
        has_labels = all(isinstance(inputs.get(k), torch.Tensor) for k in self.label_names)
        loss = None
        if has_labels:
            loss = super().prediction_step(model, inputs, True, ignore_keys, num_items_in_batch)[0]
        source = {k: v for k, v in inputs.items() if k not in _TARGET_KEYS}
        generated = self.model.generate(**source, **self._generation_kwargs())
        return loss, generated, inputs.get(self.label_names[0]) if has_labels else None

    def _generation_kwargs(self) -> dict[str, Any]:
        kwargs = dict(getattr(self, "_gen_kwargs", None) or {})
        if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None \
                and self.args.generation_max_length is not None:
            kwargs["max_length"] = self.args.generation_max_length
        if kwargs.get("num_beams") is None and self.args.generation_num_beams is not None:
            kwargs["num_beams"] = self.args.generation_num_beams
        # Ranks holding shards of the weights gather them at every forward: all must run the same number of steps.
        kwargs.setdefault("synced_gpus", self.engine.dp_size > 1 and self.engine.layout.zero_stage >= 2)
        return kwargs
