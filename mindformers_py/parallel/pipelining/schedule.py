"""Pipeline parallelism: a model cut into stages by layers (:mod:`mindformers_py.parallel.pipelining.stages`), run by
``torch.distributed.pipelining``.

:func:`build_pipeline` first cuts the model in place to what this rank holds (``cut_to_stages`` of
:mod:`~mindformers_py.parallel.pipelining.stages`), so the model keeps the full model's parameter names and holds
exactly this rank's parameters: optimizers, gradient norms and sharded (DCP) checkpoints use it unchanged, and
checkpoints written under one layout load under another. Then each stage this rank runs (one, or
``virtual_pipeline_stages`` for interleaved 1F1B, assigned round-robin: rank r holds stages r, r + pp, ...) is a
``stage_view`` of the cut model. Each view is parallelized like a whole model (tensor parallel, recompute, FSDP) and
driven by torch's schedules: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``.

**The loss comes from the caller.** The last stage calls a :data:`StageLoss` ``loss(model, inputs)`` once per
pipeline micro-batch, with that micro-batch's rows of the batch and a :class:`LastStageModel` that answers
``model(**inputs)`` as the whole model would, from the outputs the stages computed: the engine passes the
Trainer's loss there (its ``compute_loss``, a user's override or ``compute_loss_func``), normalised and rescaled
by the engine's one loss path (:mod:`mindformers_py.engine.step_loss`). Gradients are not rescaled by the schedule, so a
pipelined step computes the same loss and gradients as one stand-alone forward/backward of the whole batch.
Callers without an engine get the task's loss normalised by the batch's items. State the stages carry
(``pipeline_carry``) becomes the last stage's model's ``carried_loss(carried, labels, num_items_in_batch,
counted)``, added to the task's loss as the whole model adds it. ``counted`` is False for the one call torch makes
on placeholder tensors when a schedule first runs (to infer gradient shapes), so a model that counts its
micro-batches for the logs leaves it out; that call computes the task's loss, not the caller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor.parallel import loss_parallel

from ...errors import ConfigError, MindFormersError
from ..layout import Layout
from .stages import (
    TOKEN_IDS_KEY,
    StageTask,
    carried_names,
    last_stage_copies,
    pipeline_outputs,
    split_model,
    stage_ids_for_rank,
)

class _Stage(PipelineStage):
    """torch's pipeline stage whose shape inference leaves the stage's buffers as they were.

    When a schedule first steps, torch runs each stage once more (on the first micro-batch, or on empty tensors of
    its shapes) to infer the shapes passed between stages, and under recompute its backward inference runs the
    forward again. Buffers a model updates in training forwards (an MoE router's expert loads, which move its
    selection bias: ``MoEConfig.bias_update_rate``) would count those extra, partly uninitialised, tokens; they are
    put back after each inference."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with _buffers_kept(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with _buffers_kept(self.submod):
            return super()._backward_metadata_inference(*args, **kwargs)


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    saved = [(buffer, buffer.clone()) for buffer in module.buffers() if not buffer.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


StageLoss = Callable[[nn.Module, dict[str, Any]], torch.Tensor]
"""``loss(model, inputs)``: the loss one pipeline micro-batch back-propagates, computed on the last stage; ``inputs``
are the micro-batch's rows of the batch and ``model`` the :class:`LastStageModel` holding their outputs."""


def _task_loss(task: StageTask, config: Any, outputs: Sequence[torch.Tensor], carried: Sequence[torch.Tensor],
               labels: Sequence[torch.Tensor], num_items_in_batch: Any, stage: nn.Module | None,
               counted: bool = True, labels_shifted: bool = False) -> torch.Tensor:
    """The whole model's loss from the last stage's outputs: the task's loss normalised by ``num_items_in_batch``,
    plus the ``carried_loss`` of the state the stages carried (see
    :class:`~mindformers_py.parallel.pipelining.stages.PipelineStageMixin`). ``labels_shifted``: the labels are a
    causal LM's ``shift_labels`` (a context-parallel rank's chunk of the whole row's shifted labels)."""
    shifted = {"labels_shifted": True} if labels_shifted else {}
    loss = task.compute_loss(tuple(outputs), tuple(labels), config, num_items_in_batch, **shifted)
    extra = _carried_loss(stage, carried, labels, num_items_in_batch, counted, labels_shifted)
    return loss if extra is None else loss + extra


def _carried_loss(stage: nn.Module | None, carried: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                  num_items_in_batch: Any, counted: bool = True, labels_shifted: bool = False) -> torch.Tensor | None:
    """The last stage's model's loss from the carried state, or None. State it leaves out of the loss still
    joins the graph (times zero), so every carried tensor gets a gradient to send back."""
    if stage is None or not carried:
        return None
    shifted = {"labels_shifted": True} if labels_shifted else {}
    names = (*carried_names(stage), *pipeline_outputs(stage))
    extra = stage.carried_loss(dict(zip(names, carried)), tuple(labels), num_items_in_batch, counted=counted,
                               **shifted)
    unused = sum(t.sum() * 0.0 for t in carried if t.requires_grad)
    return unused if extra is None else extra + unused


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor (tensor parallel, FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a DTensor (vocabulary-sharded logits), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class LastStageModel:
    """What a loss function calls "the model" on the last pipeline stage: the stages already ran the micro-batch,
    so calling it returns their outputs as the whole model would return them (the task's output class, with the
    loss when the inputs hold the labels; ``num_items_in_batch`` normalises it). Other attributes (``config``,
    ``training``, ...) are the last stage's model's.

    It answers for its own micro-batch only: a loss function that calls it with other model inputs than the ones it
    was given (another forward) is refused, as that cannot run on one stage.
    """

    def __init__(self, pipeline: PipelineParallel, outputs: Sequence[torch.Tensor], carried: Sequence[torch.Tensor],
                 inputs: Mapping[str, Any], counted: bool = True) -> None:
        self._pipeline = pipeline
        self._outputs = tuple(outputs)
        self._carried = tuple(carried)
        self._inputs = inputs
        self._counted = counted

    def __call__(self, *args: Any, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        task = self._pipeline.task
        if args:
            kwargs[task.model_input] = args[0]
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor) and name not in task.label_names and name in self._inputs \
                    and value is not self._inputs[name]:
                raise MindFormersError(
                    f"under pipeline_stage > 1 the loss runs on the last stage, after the stages ran the batch: call "
                    f"model(**inputs) with the inputs the loss was given ({name!r} differs), not another forward")
        fields: dict[str, Any] = dict(zip(task.output_fields, self._outputs))
        labels = [kwargs.get(name) for name in task.label_names]
        if all(isinstance(label, torch.Tensor) for label in labels):
            # Labels already shifted replace a causal LM's labels, as in the whole model (transformers' convention).
            shifted = isinstance(kwargs.get("shift_labels"), torch.Tensor)
            fields["loss"] = _task_loss(task, self._pipeline.config, self._outputs, self._carried,
                                        [kwargs["shift_labels"]] if shifted else labels, num_items_in_batch,
                                        self._pipeline.last_part, self._counted, labels_shifted=shifted)
        return task.output_class(**fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_pipeline":  # not set yet (copying): no model to ask
            raise AttributeError(name)
        return getattr(self._pipeline.model_parts[-1], name)


# Schedules kept per (input shape, training or evaluation): torch fixes a stage's activation shapes when it first
# runs, so training and evaluation batches and a few sequence lengths of dynamically padded data each keep theirs.
MAX_CACHED_SCHEDULES = 8


class PipelineParallel:
    """This rank's share of a pipelined model and the schedules that run it.

    Build it with :func:`build_pipeline`. ``model_parts`` are the stage views this rank holds (one, or
    ``virtual_pipeline_stages`` for interleaved 1F1B); give their parameters to the optimizer. :meth:`step`
    runs forward and backward of a whole per-rank batch with a :data:`StageLoss` and returns the batch loss on
    every pipeline rank; calling the object runs forward only (evaluation) and returns the task's outputs (and
    loss, with labels) on every pipeline rank.

    Attributes:
        model_parts: this rank's stage views, in stage order.
        stage_ids: the pipeline stage index of each model part.
        task: the task the stages compute (:class:`~mindformers_py.parallel.pipelining.stages.StageTask`): model
            input, labels, output fields and, for callers without an engine, the loss.
        pp_group: the process group of this rank's pipeline.
        pp_rank: this rank's position in the pipeline.
        pp_size: number of pipeline ranks.
        micro_batches: micro-batches each batch is split into.
        has_first_stage, has_last_stage: whether this rank reads the model input / computes the loss.
    """

    def __init__(self, model_parts: list[nn.Module], stage_ids: list[int], num_stages: int,
                 layout: Layout, pp_group: dist.ProcessGroup, device: torch.device,
                 tied_group: dist.ProcessGroup | None = None, tied_names: Sequence[str] = ()) -> None:
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.num_stages = num_stages
        self.task: StageTask = model_parts[0].pipeline_task
        self.config = model_parts[0].config
        self.pp_group = pp_group
        self.device = device
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.micro_batches = layout.micro_batches
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        self.training = True
        self._schedule_cls = get_schedule_class(layout.torch_schedule_name)
        self._vocab_parallel_loss = layout.vocab_parallel
        self._tied_group = tied_group
        self._tied_names = list(tied_names)
        self._schedules: dict[tuple[Any, ...], Any] = {}
        # Loss calls still to come on placeholder tensors: a new training schedule's first step infers the gradient
        # shapes by running the stages and the loss once on empty tensors (torch's dynamic metadata inference).
        self._placeholder_losses = 0
        # The batch being stepped and its loss, for the last stage's loss calls (which receive row indices).
        self._batch: Mapping[str, Any] | None = None
        self._loss_fn: StageLoss | None = None
        self._real_rows: int | None = None  # rows of the batch being stepped that are samples (None: all)

    # -- parameters and modes ---------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Trainable parameters of every model part on this rank."""
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters with the full model's names (each name lives on exactly one pipeline rank, except tied
        embeddings, which the first and last stage both hold)."""
        for part in self.model_parts:
            yield from part.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the full model's state dict (full-model key names)."""
        out: dict[str, Any] = {}
        for part in self.model_parts:
            out.update(part.state_dict())
        return out

    def train(self, mode: bool = True) -> PipelineParallel:
        """Set training mode on every model part."""
        self.training = mode
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> PipelineParallel:
        """Set evaluation mode on every model part."""
        return self.train(False)

    @property
    def tied_copy_names(self) -> list[str]:
        """Names of this rank's parameters that duplicate another rank's (the last stage's copy of a tied
        embedding); a global gradient norm must count them once."""
        if self._tied_group is None or self.has_first_stage:
            return []
        return [name for name, _ in self.named_parameters() if name in self._tied_names]

    # -- running --------------------------------------------------------------------------------------------------

    @property
    def last_part(self) -> nn.Module | None:
        """The model part holding the last stage (None on other ranks)."""
        return self.model_parts[-1] if self.has_last_stage else None

    @property
    def carries_state(self) -> bool:
        """Whether the stages hand the model's ``pipeline_carry`` state on beside the hidden states."""
        return bool(carried_names(self.model_parts[-1]))

    def _loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: ``rows`` (the target torch splits like the inputs) are the micro-batch's
        rows of the batch being stepped. Padding rows (from :attr:`_real_rows` on) are left out of the loss: a
        micro-batch without a real row back-propagates zero."""
        counted = self._placeholder_losses == 0
        self._placeholder_losses = max(self._placeholder_losses - 1, 0)
        outputs = output if isinstance(output, tuple) else (output,)
        if counted and self._real_rows is not None:
            real = int((rows < self._real_rows).sum())  # the micro-batch's rows are consecutive: real ones first
            if real == 0:
                return sum(t.float().sum() * 0.0 for t in outputs if t.requires_grad)
            if real < rows.shape[0]:
                outputs = tuple(t.narrow(0, 0, real) if t.ndim and t.shape[0] == rows.shape[0] else t for t in outputs)
                rows = rows[:real]
        count = len(self.task.output_fields)
        inputs = self._rows(rows)
        model = LastStageModel(self, outputs[:count], outputs[count:], inputs, counted)
        if counted:
            return self._loss_fn(model, inputs)
        # torch's shape inference on placeholder tensors: any loss of every output gives the gradients' shapes.
        loss = model(**inputs).loss
        return loss if loss is not None else sum(t.float().sum() * 0.0 for t in outputs if t.requires_grad)

    def _rows(self, rows: torch.Tensor) -> dict[str, Any]:
        """The batch being stepped, cut to ``rows`` (tensors with a batch dimension; other values as they are)."""
        batch = self._batch
        size = batch[self.task.model_input].shape[0]
        return {k: v.index_select(0, rows.to(v.device)) if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == size
                else v for k, v in batch.items()}

    def task_loss(self, num_items_in_batch: Any, loss_scale: float = 1.0) -> StageLoss:
        """The :data:`StageLoss` of callers without an engine: the task's loss (the whole model's) normalised by
        ``num_items_in_batch``, times ``loss_scale``."""
        def loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
            value = model(**inputs, num_items_in_batch=num_items_in_batch).loss
            return value * loss_scale if loss_scale != 1.0 else value

        return loss

    def _batch_items(self, batches: Sequence[Mapping[str, Any]]) -> int:
        """The task's items in ``batches`` (at least 1): the default normalisation of callers without an engine."""
        return max(sum(self.task.count_items(b) or 0 for b in batches), 1)

    def _schedule_for(self, shape: tuple[int, ...], training: bool) -> Any:
        key = (*shape, training)
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            if len(self._schedules) >= MAX_CACHED_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            stages = [_Stage(part, i, self.num_stages, self.device, group=self.pp_group)
                      for part, i in zip(self.model_parts, self.stage_ids)]
            # Each micro-batch loss is already divided by the whole batch's items: no scaling by the schedule.
            # Evaluation computes no loss in the schedule (the outputs come back and the loss is taken on them).
            common = dict(n_microbatches=self.micro_batches, loss_fn=self._loss if training else None,
                          scale_grads=False)
            if issubclass(self._schedule_cls, PipelineScheduleSingle):
                schedule = self._schedule_cls(stages[0], **common)
            else:
                schedule = self._schedule_cls(stages, **common)
            if training and self.has_last_stage:
                self._placeholder_losses = 1
        self._schedules[key] = schedule  # most recently used last
        return schedule

    def _stage_inputs(self, batch: Mapping[str, Any]) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """Positional inputs of the first stage and keyword inputs of every stage, from a batch."""
        inputs = batch[self.task.model_input]
        kwargs = {}
        mask = batch.get("attention_mask")
        positions = batch.get("position_ids")
        # An all-ones mask beside positions is kept: it says the rows are not packed documents, however the
        # positions run (Megatron's reset_position_ids without reset_attention_mask), as for the whole model.
        if mask is not None and (not bool(mask.all()) or isinstance(positions, torch.Tensor)):
            kwargs["attention_mask"] = mask
        if getattr(self.config, "is_encoder_decoder", False):
            if isinstance(batch.get("decoder_attention_mask"), torch.Tensor):
                kwargs["decoder_attention_mask"] = batch["decoder_attention_mask"]
            return ((inputs, self._decoder_inputs(batch)) if self.has_first_stage else ()), kwargs
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            kwargs[TOKEN_IDS_KEY] = ids
        if isinstance(positions, torch.Tensor):  # every stage's positions (context parallelism's chunks)
            kwargs["position_ids"] = positions.expand(inputs.shape[0], -1)
        segments = batch.get("token_type_ids")
        if isinstance(segments, torch.Tensor):
            kwargs["token_type_ids"] = segments
        return ((inputs,) if self.has_first_stage else ()), kwargs

    def _decoder_inputs(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """An encoder-decoder's decoder inputs: the batch's, else its labels shifted right by the model."""
        if isinstance(batch.get("decoder_input_ids"), torch.Tensor):
            return batch["decoder_input_ids"]
        labels = batch.get(self.task.label_names[0])
        if not isinstance(labels, torch.Tensor):
            raise ConfigError("an encoder-decoder pipeline needs decoder_input_ids or labels in each batch")
        return self.model_parts[0].prepare_decoder_input_ids_from_labels(labels)

    def _shape_key(self, batch: Mapping[str, Any]) -> tuple[int, ...]:
        """The shapes a schedule is built for: the model input's, and an encoder-decoder's target length."""
        shape = tuple(batch[self.task.model_input].shape)
        if getattr(self.config, "is_encoder_decoder", False):
            target = batch.get("decoder_input_ids", batch.get(self.task.label_names[0]))
            shape += tuple(target.shape[1:]) if isinstance(target, torch.Tensor) else ()
        return shape

    def step(self, batch: Mapping[str, Any], num_items_in_batch: int | torch.Tensor | None = None,
             loss_scale: float = 1.0, sync_tied: bool = True, loss_fn: StageLoss | None = None,
             real_rows: int | None = None) -> torch.Tensor:
        """Forward and backward of one per-rank batch (the model input, labels, optional ``attention_mask``), split
        into the configured micro-batches.

        Every rank of the pipeline passes the same batch (the first stage reads the model input, the last the
        labels). ``loss_fn`` is each micro-batch's loss (:data:`StageLoss`); without one, :meth:`task_loss` with
        ``num_items_in_batch`` (HF's meaning; by default this batch's item count, which makes the loss the mean
        over items) and ``loss_scale``. Gradients accumulate into the parameters. ``sync_tied`` then sums the
        gradients of a tied embedding between the first and last stage: pass False for all but the last batch of
        an accumulation (a sum of already-summed gradients would count the earlier batches twice). Returns the
        backpropagated batch loss (detached) on every rank of the pipeline.

        ``real_rows``: how many of the batch's first rows are samples (None: all); the others are padding, left out
        of the loss. A batch the micro-batches do not divide (an epoch's last) is padded with copies of its first
        row, left out alike, so every micro-batch has the same shape.
        """
        if loss_fn is None:
            items = self._batch_items([batch]) if num_items_in_batch is None else num_items_in_batch
            loss_fn = self.task_loss(items, loss_scale)
        rows = batch[self.task.model_input].shape[0]
        real = rows if real_rows is None else min(real_rows, rows)
        extra = -rows % self.micro_batches
        if extra:
            batch = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) if isinstance(v, torch.Tensor) and v.ndim
                     and v.shape[0] == rows else v for k, v in batch.items()}
            rows += extra
        args, kwargs = self._stage_inputs(batch)
        # The last stage's loss receives the row indices of its micro-batch (torch splits the target as the inputs).
        target = torch.arange(rows, device=self.device) if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        schedule = self._schedule_for(self._shape_key(batch), training=True)
        self._batch, self._loss_fn, self._real_rows = batch, loss_fn, (real if real < rows else None)
        try:
            # Vocabulary-sharded logits (a DTensor) need torch's parallel cross-entropy.
            with loss_parallel() if self._vocab_parallel_loss else contextlib.nullcontext():
                schedule.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._batch = self._loss_fn = self._real_rows = None
        total = torch.stack([_local(loss.detach()).float() for loss in losses]).sum() if losses \
            else torch.zeros((), device=self.device)
        # The loss is known on the last rank only; the caller logs it on every rank.
        dist.broadcast(total, group_src=self.pp_size - 1, group=self.pp_group)
        if sync_tied:
            self._sync_tied_grads()
        return total

    def forward_backward(self, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: int | torch.Tensor | None = None, loss_scale: float = 1.0,
                         loss_fn: StageLoss | None = None, real_rows: Sequence[int] | None = None) -> torch.Tensor:
        """:meth:`step` over each gradient-accumulation batch of one optimizer step with ``loss_fn``; returns the
        summed loss. Without ``loss_fn``, :meth:`task_loss` with ``num_items_in_batch``, the item count of the
        whole step (by default counted from ``micro_batches``), so the sum is the step's loss. ``real_rows``: each
        batch's rows that are samples (None: all), as :meth:`step` takes them."""
        if loss_fn is None:
            items = self._batch_items(micro_batches) if num_items_in_batch is None else num_items_in_batch
            loss_fn = self.task_loss(items, loss_scale)
        total = None
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            loss = self.step(batch, sync_tied=i == last, loss_fn=loss_fn,
                             real_rows=None if real_rows is None else real_rows[i])
            total = loss if total is None else total + loss
        return total

    @torch.no_grad()
    def __call__(self, num_items_in_batch: int | torch.Tensor | None = None, **batch: Any) -> Any:
        """Forward only (evaluation), like calling the whole model with the batch's tensors: returns the task's
        output (``logits``, or start/end logits) on every pipeline rank, with the loss when the batch has labels.
        A batch whose size the micro-batches do not divide is padded with copies of its first row, cut off again
        afterwards. Other model arguments (``use_cache``, ...) are accepted and ignored."""
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        rows = tensors[self.task.model_input].shape[0]
        extra = -rows % self.micro_batches
        if extra:
            tensors = {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:])]) for k, v in tensors.items()}
        args, kwargs = self._stage_inputs(tensors)
        schedule = self._schedule_for(self._shape_key(tensors), training=False)
        output = schedule.eval(*args, **kwargs)
        outputs = [t[:rows] for t in self._broadcast_outputs(output)]
        count = len(self.task.output_fields)
        fields = dict(zip(self.task.output_fields, outputs))
        if all(isinstance(batch.get(name), torch.Tensor) for name in self.task.label_names):
            labels = [batch[name] for name in self.task.label_names]
            # The carried state came to every rank with the outputs; any part's model computes its loss.
            fields["loss"] = _task_loss(self.task, self.config, outputs[:count], outputs[count:], labels,
                                        num_items_in_batch, self.model_parts[0])
        return self.task.output_class(**fields)

    def _broadcast_outputs(self, output: Any) -> list[torch.Tensor]:
        """The last stage's output tensors on every pipeline rank."""
        if self.has_last_stage:
            tensors = [_full(t) for t in (output if isinstance(output, tuple) else (output,))]
            meta = [[(tuple(t.shape), t.dtype) for t in tensors]]
        else:
            meta = [None]
        dist.broadcast_object_list(meta, group_src=self.pp_size - 1, group=self.pp_group)
        if not self.has_last_stage:
            tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0]]
        for tensor in tensors:
            dist.broadcast(tensor.contiguous(), group_src=self.pp_size - 1, group=self.pp_group)
        return tensors

    def _sync_tied_grads(self) -> None:
        """Sum the gradients of weights shared by the first and last stage (tied input/output embeddings):
        each stage holds its own copy, and both copies must take the same update."""
        if self._tied_group is None:
            return
        for part in self.model_parts:
            params = dict(part.named_parameters(remove_duplicate=False))
            seen: set[int] = set()  # one tensor under two names (a tied head beside an embedding copy): once
            for name in self._tied_names:
                param = params.get(name)
                if param is not None and param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    dist.all_reduce(_local(param.grad), group=self._tied_group)


def _tied_weight_names(model: nn.Module) -> list[str]:
    """Names of the weights the first and last stage would both hold (tied input/output embeddings, and the
    copies of first-stage modules the last stage holds: :func:`~.stages.last_stage_copies`)."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix)
    names = [f"{prefix}.{path}.{name}" for path in last_stage_copies(model)
             for name, _ in base.get_submodule(path).named_parameters()]
    if not getattr(model.config, "tie_word_embeddings", False):
        return names
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return [*(list(tied) + list(tied.values()) if isinstance(tied, Mapping) else list(tied)), *names]


def _pp_group(mesh: Any) -> dist.ProcessGroup:
    """The pipeline process group of ``mesh``: a :class:`~mindformers_py.parallel.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"``
    dimension, a 1-D pipeline ``DeviceMesh``, or None (the whole world)."""
    if mesh is None:
        return dist.group.WORLD
    if hasattr(mesh, "pp_mesh"):
        return mesh.pp_mesh.get_group()
    if isinstance(mesh, DeviceMesh) and mesh.ndim > 1:
        return mesh["pp"].get_group()
    return mesh.get_group()


def _tied_group(group: dist.ProcessGroup, pp_rank: int, pp_size: int) -> dist.ProcessGroup | None:
    """The group of this pipeline's first and last rank, which both hold the tied embedding (None elsewhere)."""
    if pp_size == 2:
        return group
    if pp_rank not in (0, pp_size - 1):
        return None
    ranks = dist.get_process_group_ranks(group)
    # Only the two members take part in creating the group; the middle ranks hold no tied weight.
    return dist.new_group([ranks[0], ranks[-1]], use_local_synchronization=True)


def build_pipeline(
    model: nn.Module,
    layout: Layout,
    mesh: Any = None,
    device: torch.device | str | None = None,
    parallelize: Callable[[nn.Module], nn.Module | None] | None = None,
    task: StageTask | None = None,
) -> PipelineParallel:
    """Cut ``model`` in place to this rank's stages and return them ready to run with torch's schedules.

    Args:
        model: a model declaring a pipeline plan (``GPTForCausalLM``, ``GPTForSequenceClassification``, ...),
            with the same weights on every rank (same seed or same checkpoint). It is cut in place (:func:`cut_to_stages`): afterwards it holds exactly this rank's
            parameters under the full model's names.
        layout: the resolved layout; gives ``pp``, ``vpp``, ``micro_batches``,
            ``pipeline_schedule`` (and, for the stages' inputs and the loss, sequence and vocabulary parallelism).
        mesh: the run's :class:`~mindformers_py.parallel.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"`` dimension or a 1-D
            pipeline mesh; None uses the whole world as the pipeline.
        device: where the stages run (default: the current CUDA device with NCCL, else CPU).
        parallelize: applied to each stage view (tensor parallel, recompute, data parallel / ZeRO, in
            torchtitan's order; ``part.pp_rank`` gives the stage for per-stage settings); it may return a wrapping
            module or modify the part in place and return None.
        task: the task the stages compute (the engine passes the Trainer's task registry entry); None takes the
            model's own (its ``task_spec``).
    """
    pp, vpp = layout.pp, layout.vpp
    group = _pp_group(mesh)
    if dist.get_world_size(group) != pp:
        raise ConfigError(
            f"pipeline_stage={pp} does not match the pipeline process group of {dist.get_world_size(group)} ranks"
        )
    pp_rank = dist.get_rank(group)
    if device is None:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    device = torch.device(device)
    num_chunks = pp * vpp
    chunk_ids = stage_ids_for_rank(pp_rank, pp, vpp)
    tied_names = _tied_weight_names(model) if pp > 1 else []
    if not any(p.is_meta for p in model.parameters()):  # weights still on meta are filled stage by stage
        model.to(device)
    parts: list[nn.Module] = []
    for part in split_model(model, num_chunks, chunk_ids, pp, task=task):
        part.sequence_shards = layout.tp if layout.sequence_parallel else 1
        if parallelize is not None:
            part = parallelize(part) or part
        parts.append(part)
    tied_group = _tied_group(group, pp_rank, pp) if tied_names else None
    return PipelineParallel(parts, chunk_ids, num_chunks, layout, group, device, tied_group, tied_names)
