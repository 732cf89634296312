"""The Trainer's training loss: :meth:`~TrainingLossMixin.compute_loss` (transformers' signature), how its value
relates to ``num_items_in_batch`` (what :mod:`mindformers_py.engine.step_loss` needs to normalise it), the fused
causal-LM loss, and the non-finite check kept on the device.

:class:`TrainingLossMixin` is a part of :class:`~mindformers_py.trainer.Trainer`, kept in its own file (as
:class:`~mindformers_py.trainer.evaluation.EvaluationMixin` is); it reads the Trainer's ``args``, ``engine``,
``model``, ``state``, ``task``, ``task_spec``, ``label_names``, ``compute_loss_func``, ``loss_is_scaled_for_ga``
and ``model_accepts_loss_kwargs``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..engine.step_loss import NORMALISED, UNKNOWN, probe_mode
from ..errors import MindFormersError
from ..layers.loss import IGNORE_INDEX
from ..layers.loss.fused_head import TAKEN, fusing_modules, loss_without_logits
from .fused_loss import FusedCausalLMLoss, ModelFusedLoss

logger = logging.getLogger(__name__)


class TrainingLossMixin:
    """``compute_loss`` and the loss helpers of the :class:`~mindformers_py.trainer.Trainer` (the engine's
    :class:`~mindformers_py.engine.TrainingLoss` is built from them)."""

    def _count_items(self, batch: Mapping[str, Any]) -> int | None:
        """Items of the loss in one batch (the task's count; for a model of no known task, label entries that are
        not -100, as transformers' Trainer counts them)."""
        if self.task_spec is not None and tuple(self.label_names) == self.task_spec.label_names:
            return self.task_spec.count_items(batch)
        labels = batch.get(self.label_names[0])
        return int((labels != IGNORE_INDEX).sum()) if isinstance(labels, torch.Tensor) else None

    def _measure_loss_mode(self, micro_batches: list[Mapping[str, Any]]) -> None:
        """Measure once, on the first labelled micro-batch, whether the model divides its loss by
        ``num_items_in_batch`` (only for models that take it without declaring ``accepts_loss_kwargs``)."""
        if self._loss_mode != UNKNOWN or self._loss_mode_measured or self._loss_override() is not None:
            return
        for batch in micro_batches:
            mode = probe_mode(self.model, self.engine.to_device(batch), self._count_items)
            if mode is not None:
                self._loss_mode, self._loss_mode_measured = mode, True
                return

    def _loss_override(self) -> str | None:
        """The name of the user's loss (``compute_loss_func`` or an overridden ``compute_loss``), else None."""
        if self.compute_loss_func is not None:
            return "compute_loss_func"
        if type(self).compute_loss is not TrainingLossMixin.compute_loss:
            return f"{type(self).__name__}.compute_loss"
        return None

    def _compute_training_loss(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """:meth:`compute_loss` of one training micro-batch: the loss function of :attr:`training_loss`."""
        return self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    def _share_mode(self, inputs: Mapping[str, Any]) -> str:
        """How :meth:`compute_loss`'s value relates to ``num_items_in_batch`` (see
        :mod:`mindformers_py.engine.step_loss`): the fused loss and a ``compute_loss_func`` divide by it; an
        overriding ``compute_loss`` does as ``loss_is_scaled_for_ga`` says, else it is trusted to when the model
        takes it (transformers' rule); else what the model was found to do."""
        if isinstance(self._fused_loss, FusedCausalLMLoss) and "labels" in inputs:
            return NORMALISED
        if self.compute_loss_func is not None:
            return NORMALISED
        if type(self).compute_loss is not TrainingLossMixin.compute_loss:
            if self.loss_is_scaled_for_ga is not None:
                return NORMALISED if self.loss_is_scaled_for_ga else UNKNOWN
            return NORMALISED if self.model_accepts_loss_kwargs else UNKNOWN
        return self._loss_mode

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The loss of one batch (HF's signature; override to change the objective). With a ``compute_loss_func``
        it is that function of the model's outputs and the batch's ``labels`` (transformers' rule); else the fused
        causal-LM loss when it applies (see ``TrainingArguments.fused_loss``), else ``model(**inputs).loss``."""
        if self.compute_loss_func is not None and "labels" in inputs:
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            kwargs = {"num_items_in_batch": num_items_in_batch} \
                if num_items_in_batch is not None and self.model_accepts_loss_kwargs else {}
            outputs = model(**inputs, **kwargs)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        fused = self._fused_for(inputs) if not return_outputs else None
        if isinstance(fused, FusedCausalLMLoss):
            return fused(inputs, num_items_in_batch)
        kwargs = {"num_items_in_batch": num_items_in_batch} \
            if num_items_in_batch is not None and self.model_accepts_loss_kwargs else {}
        with self._fused_in_model(model, fused):
            outputs = model(**inputs, **kwargs)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
        if loss is None:
            raise MindFormersError(
                f"the model returned no loss for a batch with keys {sorted(inputs)}; training needs "
                f"{self.label_names[0]!r} in the batch (set by the data collator)"
            )
        return (loss, outputs) if return_outputs else loss

    def _fused_possible(self) -> bool:
        return (self.args.fused_loss and self.task == "causal_lm" and not self.args.torch_compile
                and self.engine.supports_model_fused_loss)

    def _fused_for(self, inputs: Mapping[str, Any]) -> FusedCausalLMLoss | ModelFusedLoss | None:
        """The fused causal-LM loss for a batch with labels, decided on the first one: the model's own fused head
        (:mod:`~mindformers_py.layers.loss.fused_head`: a model of ours, called whole, so under every engine), else
        one applied from outside (another model, where the engine leaves it unwrapped and the probe agrees)."""
        if not self._fused_probed and self._fused_possible() and isinstance(inputs.get("labels"), torch.Tensor):
            if fusing_modules(self.model):
                self._fused_loss = ModelFusedLoss()
            elif self.engine.supports_fused_loss:
                self._fused_loss = FusedCausalLMLoss.probe(self.model, inputs)
                logger.info("causal-LM loss: %s", "fused linear cross-entropy" if self._fused_loss else "the model's own")
            self._fused_probed = True
        return self._fused_loss if "labels" in inputs else None

    @contextmanager
    def _fused_in_model(self, model: nn.Module, fused: Any) -> Iterator[None]:
        """Around one call of ``model`` with labels: its head fused with its loss when ``fused`` is the model's own
        (:class:`ModelFusedLoss`); the first such call logs whether the head could be fused."""
        if not isinstance(fused, ModelFusedLoss):
            yield
            return
        with loss_without_logits(model) as modules:
            yield
        if not fused.reported:
            fused.reported = True
            if not self.is_world_process_zero():  # (every rank decides alike; one line for the run)
                return
            taken = any(getattr(m, TAKEN, False) for m in modules)
            logger.info("causal-LM loss: %s", "fused linear cross-entropy (in the model's forward)" if taken else
                        "the model's own: its output head is sharded or adapted, which the fused loss cannot read")

    # -- non-finite losses: tracked on the device, checked where the loop syncs anyway -------------------------------

    def _note_nonfinite(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss) & (self._first_bad_step < 0)
        self._first_bad_step = torch.where(bad, self.state.global_step, self._first_bad_step)
        if self.engine.device.type == "cpu":  # no device to wait for: check every step
            self._check_finite()

    def _check_finite(self) -> None:
        step = int(self._first_bad_step)
        if step >= 0:
            raise MindFormersError(
                f"the training loss is not finite (nan or inf) at step {step}: lower learning_rate, keep "
                "max_grad_norm > 0, prefer bf16 to fp16, and check the data (a step whose labels are all -100 "
                "has no tokens to average)"
            )
