"""The Trainer's evaluation and prediction (transformers' ``evaluate`` / ``predict`` / ``prediction_step``): one
pass over a dataset without gradients, sharded over the data-parallel ranks, its loss averaged over label tokens
and its predictions gathered for ``compute_metrics``.

:class:`EvaluationMixin` is a part of :class:`~mindformers_py.trainer.Trainer`, kept in its own file; it reads the
Trainer's ``args``, ``engine``, ``model`` / ``model_wrapped``, ``state``, ``control``, ``callback_handler``,
``compute_metrics``, ``preprocess_logits_for_metrics``, ``label_names``, ``task_spec`` and its loss helpers.
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any, Mapping

import torch
from torch import nn
from transformers.trainer_pt_utils import nested_concat, nested_numpify
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, PredictionOutput, speed_metrics

from ..errors import MindFormersError
from ..utils.batch_rows import first_rows
from .batching import GlobalBatchSampler, build_dataloader, is_stream, map_style_length
from .fused_loss import FusedCausalLMLoss


class EvaluationMixin:
    """``evaluate``, ``predict`` and ``prediction_step`` of the :class:`~mindformers_py.trainer.Trainer` (with
    transformers' signatures and metric names); under a layout needing more processes than this one, they run in
    the Trainer's local workers and return rank 0's result."""

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (default: the Trainer's); returns ``{prefix}_loss`` (mean over label
        tokens), ``{prefix}_perplexity`` for language-modelling tasks, ``compute_metrics``' results and speed.
        A dict of datasets is evaluated one by one with prefixes ``{prefix}_{name}``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise MindFormersError("evaluate needs an eval_dataset (pass one to the Trainer or to evaluate)")
        if self._workers is not None:
            return self._workers.run(self, EvaluationMixin.evaluate, eval_dataset, ignore_keys, metric_key_prefix)
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        loss_only = self.compute_metrics is None or self.args.prediction_loss_only
        output = self._evaluation_loop(dataset, "eval_dataset", loss_only, ignore_keys, metric_key_prefix)
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)
        return output.metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (logits, or ``preprocess_logits_for_metrics`` of them) for ``test_dataset`` as NumPy
        arrays, its label ids when it has labels (a tuple of arrays with several ``label_names``), and metrics
        (loss, ``compute_metrics``, speed). With ``args.prediction_loss_only`` only the loss is computed: no
        predictions, no label ids, no ``compute_metrics`` (transformers' rule)."""
        if self._workers is not None:
            return self._workers.run(self, EvaluationMixin.predict, test_dataset, ignore_keys, metric_key_prefix)
        output = self._evaluation_loop(test_dataset, "test_dataset", self.args.prediction_loss_only, ignore_keys,
                                       metric_key_prefix)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, num_items_in_batch: Any = None
                        ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """``(loss, logits, labels)`` of one batch without gradients (HF's signature). The loss is normalised
        by ``num_items_in_batch`` when given (and the loss accepts it), else a mean over the batch. ``labels`` is
        a tuple when there are several ``label_names`` (a QA model's start and end positions), as in transformers."""
        has_labels = all(isinstance(inputs.get(k), torch.Tensor) for k in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[k] for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        fused = self._fused_for(inputs) if prediction_loss_only and has_labels else None
        if isinstance(fused, FusedCausalLMLoss):
            return fused(inputs, num_items_in_batch), None, None
        kwargs: dict[str, Any] = {}
        if has_labels and num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            kwargs["num_items_in_batch"] = num_items_in_batch
        if _accepts(self.model, "use_cache"):
            kwargs["use_cache"] = False
        if has_labels and self._loss_override() is not None:  # the user's loss, as transformers evaluates it
            extra = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
            loss, outputs = self.compute_loss(model, {**inputs, **extra}, return_outputs=True,
                                              num_items_in_batch=num_items_in_batch)
        else:
            with self._fused_in_model(model, fused):
                outputs = self.engine.forward(model, inputs, **kwargs)
            loss = (outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]) if has_labels else None
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys is None:
            ignore_keys = list(getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference", []) or [])
        if isinstance(outputs, Mapping):
            logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
        else:
            logits = tuple(outputs[1:] if has_labels else outputs)
        return loss, logits[0] if len(logits) == 1 else logits, labels

    def _evaluation_loop(self, dataset: Any, description: str, prediction_loss_only: bool,
                         ignore_keys: list[str] | None, metric_key_prefix: str) -> EvalLoopOutput:
        args, engine = self.args, self.engine
        dataset, collate = self._prepared(dataset, description)
        if is_stream(dataset):  # evaluation reads every sample once, in order: a stream is read whole first
            dataset = list(dataset)
        num_samples = map_style_length(dataset, description)
        if num_samples == 0:
            raise MindFormersError(f"{description} is empty")
        sampler = GlobalBatchSampler(num_samples, args.per_device_eval_batch_size * engine.dp_size,
                                     engine.shard_indices, shuffle=False, share=engine.batch_share)
        loader = build_dataloader(dataset, sampler, collate, args.dataloader_num_workers,
                                  args.dataloader_pin_memory and engine.device.type == "cuda",
                                  args.dataloader_prefetch_factor, args.seed, persistent=False)
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        start = time.time()
        loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
        items = 0
        predictions: Any = None
        label_ids: Any = None
        try:
            with torch.no_grad():
                # A rank without a share of the last batch runs its padding row (for the layout's collectives) and
                # keeps nothing of it: the loss, the counts and the gathered predictions are of the real rows only.
                for batch, real in zip(loader, sampler.real_rows()):
                    engine.beat(self.state.global_step)
                    n_items = self._count_items(first_rows(batch, real))
                    inputs = engine.to_device(batch)
                    with engine.autocast():
                        loss, logits, labels = self.prediction_step(
                            model, inputs, prediction_loss_only, ignore_keys,
                            torch.tensor(n_items, device=engine.device) if n_items else None)
                    if loss is not None and n_items:
                        loss_sum += loss.double() * n_items
                        items += n_items
                    if logits is not None:
                        if self.preprocess_logits_for_metrics is not None:
                            logits = self.preprocess_logits_for_metrics(logits, labels)
                        predictions = _concat(predictions, engine.gather_for_metrics(_to_cpu(logits, real)))
                    if labels is not None and not prediction_loss_only:
                        label_ids = _concat(label_ids, engine.gather_for_metrics(_to_cpu(labels, real)))
                    self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
        finally:
            model.train(was_training)
        loss_sum = engine.all_reduce_sum(loss_sum)
        items = int(engine.all_reduce_sum(torch.tensor(items, device=engine.device)))
        metrics: dict[str, float] = {}
        if items:
            mean = float(loss_sum) / items
            metrics[f"{metric_key_prefix}_loss"] = mean
            if self.task_spec is not None and self.task_spec.perplexity:
                metrics[f"{metric_key_prefix}_perplexity"] = math.exp(mean) if mean < 700 else math.inf
        predictions = nested_numpify(predictions) if predictions is not None else None
        label_ids = nested_numpify(label_ids) if label_ids is not None else None
        if self.compute_metrics is not None and predictions is not None and label_ids is not None:
            computed = self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
            for key, value in (computed or {}).items():
                name = key if key.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{key}"
                metrics[name] = value.item() if hasattr(value, "item") else value
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_samples, num_steps=len(loader)))
        return EvalLoopOutput(predictions=predictions, label_ids=label_ids, metrics=metrics, num_samples=num_samples)


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _concat(done: Any, parts: list[Any]) -> Any:
    """``done`` followed by ``parts`` along the batch dimension (ragged sequence lengths padded with -100)."""
    for part in parts:
        done = part if done is None else nested_concat(done, part, padding_index=-100)
    return done


def _to_cpu(value: Any, rows: int | None = None) -> Any:
    """``value`` (a tensor or a nest of them) on the CPU, cut to its first ``rows`` rows (None: all)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return (value[:rows] if rows is not None and value.ndim else value).cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v, rows) for v in value)
    return value
