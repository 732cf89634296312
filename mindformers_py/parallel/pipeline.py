"""Pipeline parallelism: a model cut into stages by layers, run by ``torch.distributed.pipelining``.

**The model is its own stage** (torchtitan's way). The cut follows the plans the model declares
(``config.base_model_pp_plan`` and the head's ``_pp_plan``): modules listed before ``layers`` (token and position
embeddings) live on the first stage, ``layers`` is split into contiguous ranges, and modules listed after it (final
norm, head) live on the last stage, where the task's loss is computed. A stage is the model itself with the parts
it does not hold set to None: its own ``forward`` skips them (a base model without ``embed_tokens`` takes the
previous stage's hidden states as ``inputs_embeds``; a head model without its head returns the base output). No
stage code repeats the model's forward.

:func:`build_pipeline` first cuts the model in place to what this rank holds (:func:`cut_to_stages`: its layers
under their original indices, the embeddings / norm and head only on the first / last stage), so the model keeps
the full model's parameter names and holds exactly this rank's parameters: optimizers, gradient norms and sharded
(DCP) checkpoints use it unchanged, and checkpoints written under one layout load under another. Then each stage
this rank runs (one, or ``virtual_pipeline_stages`` for interleaved 1F1B, assigned round-robin: rank r holds
stages r, r + pp, ...) is a :func:`stage_view` of the cut model: a shallow copy sharing its modules, holding one
stage's layers, whose class adds :class:`PipelineStageMixin` so torch's ``PipelineStage`` can call it with
tensors and receive tensors. Each view is parallelized like a whole model (tensor parallel, recompute, FSDP) and
driven by torch's schedules: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``.

An encoder-decoder declares two stacks in its plan, in order (``encoder.layers`` then ``decoder.layers``): the
stages split the encoder's layers then the decoder's, the modules listed between the stacks (the encoder's final
norm) live on the stage of the encoder's last layer, and the activations handed between stages are tuples (see
:class:`EncoderDecoderStageMixin`): the encoder's output travels with the decoder's hidden states to every
decoder stage, which all attend to it.

The loss of a micro-batch is the task's loss (:mod:`mindformers_py.task_registry`) summed over its items and
divided by the items of the whole batch (``num_items_in_batch``), and gradients are not rescaled by the
schedule, so a pipelined step computes the same loss and gradients as one stand-alone forward/backward of the
whole batch.

**Extra loss state travels with the hidden states.** A model may name, in ``pipeline_carry``, base-model outputs
that later stages need (an MoE model's per-layer router statistics, from which the router loss is computed): each
stage then takes them as keyword arguments and returns them beside its hidden states (torch's ``PipelineStage``
sends every tensor of a tuple on, and their gradients back), and the last stage adds the model's
``carried_loss(carried, labels, num_items_in_batch, counted)`` to the task's loss. ``counted`` is False for the
one call torch makes on placeholder tensors when a schedule first runs (to infer gradient shapes), so a model that
counts its micro-batches for the logs leaves it out.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor.parallel import loss_parallel

from ..errors import ConfigError
from ..task_registry import TaskSpec, task_of_model
from .config import ParallelConfig

LAYERS_KEY = "layers"
# The keyword under which every stage receives the batch's token ids (heads that pool by token, such as the
# GPT sequence classifier, read them on the last stage).
TOKEN_IDS_KEY = "token_ids"


def layer_ranges(num_layers: int, num_chunks: int) -> list[range]:
    """Split ``num_layers`` transformer layers into ``num_chunks`` contiguous ranges, as even as possible.

    Left-over layers go to the earliest chunks: the last chunk also runs the head and the loss, whose cost
    grows with the vocabulary, so it is the one that gets the smaller share.
    """
    if num_chunks < 1 or num_layers < num_chunks:
        raise ConfigError(
            f"pipeline chunks={num_chunks} is not valid for num_hidden_layers={num_layers}; "
            f"expected between 1 and {num_layers} chunks (each needs a layer)"
        )
    base, extra = divmod(num_layers, num_chunks)
    ranges, start = [], 0
    for chunk in range(num_chunks):
        size = base + (1 if chunk < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank``: round-robin ("looped"), as interleaved 1F1B expects."""
    return [pp_rank + chunk * pp_size for chunk in range(virtual_stages)]


class LayerSlice(nn.ModuleDict):
    """Some layers of a ``ModuleList``, keyed by their index in the full model.

    Iterating yields the layers (not the keys, unlike ``ModuleDict``), so code written for the full
    ``ModuleList`` runs unchanged, while parameter names keep the full model's numbering.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


@dataclass(frozen=True)
class StagePlan:
    """Where a model's pipeline plan (transformers merges ``config.base_model_pp_plan`` under the base-model prefix
    with the head's ``_pp_plan``) puts each part. Paths are dotted, relative to the base model (``head``: to the
    model itself)."""

    stacks: tuple[str, ...]
    """The layer stacks split over the stages, in execution order (``layers``; ``encoder.layers``,
    ``decoder.layers``): entries named ``layers`` or ending in ``.layers``."""
    first: tuple[str, ...]
    """Modules before the first stack (embeddings, position biases): on the first stage."""
    after: tuple[tuple[str, ...], ...]
    """For each stack, the modules listed after it (before the next stack): on the stage holding its last layer
    (the final norm of a decoder-only model, on the last stage)."""
    head: tuple[str, ...]
    """The head's modules: on the last stage."""


def stage_plan(model: nn.Module) -> StagePlan:
    """The :class:`StagePlan` of ``model``; a model declaring no stack of layers is refused."""
    prefix = getattr(model, "base_model_prefix", "model") + "."
    plan = list(getattr(model, "_pp_plan", None) or {})
    base = [name[len(prefix):] for name in plan if name.startswith(prefix)]
    stacks = [name for name in base if name == LAYERS_KEY or name.endswith(f".{LAYERS_KEY}")]
    if not stacks:
        raise ConfigError(
            f"pipeline_stage > 1 is not supported for {type(model).__name__}: it declares no pipeline plan "
            f"(base_model_pp_plan) with a '{LAYERS_KEY}' entry; use pipeline_stage=1"
        )
    bounds = [base.index(stack) for stack in stacks] + [len(base)]
    after = tuple(tuple(base[bounds[i] + 1 : bounds[i + 1]]) for i in range(len(stacks)))
    head = tuple(name for name in plan if not name.startswith(prefix))
    return StagePlan(tuple(stacks), tuple(base[: bounds[0]]), after, head)


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(the module holding ``path``'s last part, that part's name)."""
    *parents, name = path.split(".")
    for part in parents:
        root = getattr(root, part)
    return root, name


def _indexed_layers(layers: nn.Module) -> dict[int, nn.Module]:
    """A stack's layers by their index in the full model (from a ``ModuleList`` or a :class:`LayerSlice`)."""
    if isinstance(layers, LayerSlice):
        return {int(key): layer for key, layer in layers.items()}
    return dict(enumerate(layers))


def stack_sizes(model: nn.Module) -> tuple[int, ...]:
    """Layers of each stack of the full model (kept on the model when it is cut, as a cut stack holds fewer)."""
    sizes = getattr(model, "_pipeline_stack_sizes", None)
    if sizes is None:
        base = getattr(model, model.base_model_prefix)
        sizes = tuple(len(getattr(*_owner(base, stack))) for stack in stage_plan(model).stacks)
    return sizes


def _drop_parts(model: nn.Module, slots: Iterable[int], is_first: bool, is_last: bool) -> None:
    """Keep the layers at ``slots`` (positions in the stacks laid end to end, under their indices in their stack)
    and, only on the stages the plan names, the other modules; the rest become None."""
    plan = stage_plan(model)
    sizes = stack_sizes(model)
    base = getattr(model, model.base_model_prefix)
    held, start = set(slots), 0
    for stack, size, after in zip(plan.stacks, sizes, plan.after):
        owner, name = _owner(base, stack)
        layers = _indexed_layers(getattr(owner, name))
        setattr(owner, name, LayerSlice({str(i): layers[i] for i in range(size) if start + i in held}))
        _keep(base, after, start + size - 1 in held)
        start += size
    _keep(base, plan.first, is_first)
    _keep(model, plan.head, is_last)
    model._pipeline_stack_sizes = sizes


def _keep(root: nn.Module, paths: Iterable[str], kept: bool) -> None:
    if kept:
        return
    for path in paths:
        owner, name = _owner(root, path)
        if getattr(owner, name, None) is not None:
            setattr(owner, name, None)


def cut_to_stages(model: nn.Module, layer_ids: Iterable[int], holds_first: bool, holds_last: bool) -> nn.Module:
    """Cut ``model`` in place down to what one pipeline rank holds: the layers ``layer_ids`` (positions in the stacks
    laid end to end; kept under their original indices), the first stage's modules when ``holds_first``, the last
    stage's when ``holds_last`` and each stack's closing modules with its last layer. Its parameters are then
    exactly the rank's, under the full model's names. Returns ``model``."""
    _drop_parts(model, layer_ids, holds_first, holds_last)
    return model


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children, parameters and buffers, with containers of its own (the
    children, hook and name tables), so parts can be set to None and hooks (FSDP's) registered on the copy alone."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set, list)):
            clone.__dict__[key] = copy.copy(value)
    return clone


class PipelineStageMixin:
    """Lets torch's ``PipelineStage`` call a model cut to one stage: it passes tensors and receives tensors.

    ``forward(inputs, *carried, attention_mask=None, token_ids=None, token_type_ids=None)``: ``inputs`` is the task's model
    input on the first stage (token ids, pixel values) and the previous stage's hidden states elsewhere (which the
    model takes as ``inputs_embeds``, its embeddings being absent, with the positions of the whole sequence);
    ``token_ids`` are the batch's token ids, handed to every stage for heads that read them; ``token_type_ids``
    (segments of sentence pairs) go to the first stage's embeddings. A stage before the last returns its hidden states; the last returns the task's
    output fields (``logits``, or ``(start_logits, end_logits)``), on which the loss is computed.

    Attributes set by :func:`stage_view`: ``stage_index``, ``pp_rank``, ``layer_ids``, ``is_first``, ``is_last``,
    ``pipeline_task`` (the :class:`~mindformers_py.task_registry.TaskSpec`) and ``sequence_shards`` (the
    tensor-parallel size under sequence parallelism: the hidden states a later stage receives are that many times
    shorter than the sequence, which positions and masks must cover).

    With carried state (the model's ``pipeline_carry`` names), ``carried`` are the previous stage's tensors of
    those names (none on the first stage), and every stage returns them after its hidden states (the last stage:
    after the task's outputs).
    """

    def forward(self, inputs: torch.Tensor, *carried: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        spec: TaskSpec = self.pipeline_task
        names = carried_names(self)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
        if self.is_first:  # the model numbers the positions itself (RoBERTa's count only real tokens)
            kwargs[spec.model_input] = inputs
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
        else:
            length = inputs.shape[1] * self.sequence_shards
            kwargs["position_ids"] = torch.arange(length, device=inputs.device)[None]
            kwargs["inputs_embeds"] = inputs
            kwargs.update(zip(names, carried))
            if token_ids is not None:
                kwargs["input_ids"] = token_ids
        out = super().forward(**kwargs)
        state = tuple(out[name] for name in names)
        if not self.is_last:
            return (out.last_hidden_state, *state) if state else out.last_hidden_state
        fields = (*spec.outputs_of(out), *state)
        return fields[0] if len(fields) == 1 else fields


def carried_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the tensors ``model`` carries from pipeline stage to stage besides its hidden states (its
    ``pipeline_carry``; needs a ``carried_loss`` to use them on the last stage)."""
    if not callable(getattr(model, "carried_loss", None)):
        return ()
    return tuple(getattr(model, "pipeline_carry", ()) or ())


_STAGE_CLASSES: dict[type, type] = {}
class EncoderDecoderStageMixin(PipelineStageMixin):
    """:class:`PipelineStageMixin` for encoder-decoders (T5), whose stages hand tuples of tensors on.

    The first stage takes ``(input_ids, decoder_input_ids)``, embeds both and computes both stacks' position
    biases. Until the encoder's last layer, stages pass ``(encoder hidden, decoder hidden, encoder bias, decoder
    bias)``; from the stage holding it on, ``(encoder output, decoder hidden, decoder bias)``: every decoder stage
    cross-attends to the encoder output it received and passes it on. The keyword inputs (``attention_mask`` of the
    source, ``decoder_attention_mask``) reach every stage.

    The model's ``forward`` takes transformers' encoder-decoder arguments (``encoder_outputs``,
    ``decoder_inputs_embeds``, ...) and ``encoder_position_bias`` / ``decoder_position_bias`` /
    ``return_position_bias`` (the biases computed by the first stage, and whether to return them).
    """

    def forward(self, *inputs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        encoder_layers = self._pipeline_stack_sizes[0]
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "decoder_attention_mask": decoder_attention_mask,
                                  "use_cache": False, "return_position_bias": not self.is_last}
        if self.is_first:
            kwargs.update(input_ids=inputs[0], decoder_input_ids=inputs[1])
        elif self.layer_ids[0] >= encoder_layers:  # the encoder finished on an earlier stage
            encoded, decoded, decoder_bias = inputs
            kwargs.update(encoder_outputs=(encoded,), decoder_inputs_embeds=decoded, decoder_position_bias=decoder_bias)
        else:
            encoded, decoded, encoder_bias, decoder_bias = inputs
            kwargs.update(inputs_embeds=encoded, decoder_inputs_embeds=decoded, encoder_position_bias=encoder_bias,
                          decoder_position_bias=decoder_bias)
        out = super(PipelineStageMixin, self).forward(**kwargs)
        if self.is_last:
            fields = self.pipeline_task.outputs_of(out)
            return fields[0] if len(fields) == 1 else fields
        if self.layer_ids[-1] >= encoder_layers - 1:
            sent = (out.encoder_last_hidden_state, out.last_hidden_state, out.decoder_position_bias)
        else:
            sent = (out.encoder_last_hidden_state, out.last_hidden_state, out.encoder_position_bias,
                    out.decoder_position_bias)
        return tuple(t.contiguous() for t in sent)  # torch receives into contiguous buffers of the sent strides


_STAGE_CLASSES: dict[tuple[type, type], type] = {}


def _stage_class(cls: type, mixin: type = PipelineStageMixin) -> type:
    """``cls`` with ``mixin`` (:class:`PipelineStageMixin` or :class:`EncoderDecoderStageMixin`) in front (made once
    per model class)."""
    if (cls, mixin) not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls, mixin] = type(f"{cls.__name__}Stage", (mixin, cls), {"__module__": cls.__module__})
    return _STAGE_CLASSES[cls, mixin]


def stage_view(model: nn.Module, layers: range, is_first: bool, is_last: bool, task: TaskSpec | None = None) -> nn.Module:
    """One stage of ``model`` (cut by :func:`cut_to_stages` or whole) as a module torch's schedules can run: a
    shallow copy sharing the model's modules (no weight is copied), holding ``layers`` and, on the first / last
    stage, the embeddings / norm and head (see :class:`PipelineStageMixin`). Its state-dict keys are the full
    model's. ``task`` defaults to the model's own (from its class name)."""
    plan = stage_plan(model)  # refuses a model without a pipeline plan
    task = task or task_of_model(model)
    if task is None:
        raise ConfigError(f"pipeline_stage > 1 needs a model of a known task; {type(model).__name__} has none "
                          "(its class name ends in no task suffix of the task registry)")
    view = _shallow_copy(model)
    prefix = model.base_model_prefix
    view._modules[prefix] = _shallow_copy(getattr(model, prefix))
    # Every module holding a planned part gets its own copy, so parts are set to None on the view alone.
    copied = {id(view._modules[prefix])}
    for path in (*plan.first, *plan.stacks, *(p for after in plan.after for p in after)):
        owner = view._modules[prefix]
        for part in path.split(".")[:-1]:
            child = owner._modules[part]
            if id(child) not in copied:
                child = owner._modules[part] = _shallow_copy(child)
                copied.add(id(child))
            owner = child
    _drop_parts(view, layers, is_first, is_last)
    mixin = EncoderDecoderStageMixin if getattr(model.config, "is_encoder_decoder", False) else PipelineStageMixin
    view.__class__ = _stage_class(type(model), mixin)
    view.layer_ids, view.is_first, view.is_last = layers, is_first, is_last
    view.stage_index, view.pp_rank, view.sequence_shards, view.pipeline_task = 0, 0, 1, task
    return view


def split_model(model: nn.Module, num_chunks: int, chunk_ids: list[int], pp_size: int = 1) -> list[nn.Module]:
    """Cut ``model`` in place to the chunks ``chunk_ids`` of ``num_chunks`` (:func:`layer_ranges`; chunk ``i``
    runs on pipeline rank ``i % pp_size``) and return their stage views, in order."""
    ranges = layer_ranges(sum(stack_sizes(model)), num_chunks)
    held = [i for chunk in chunk_ids for i in ranges[chunk]]
    cut_to_stages(model, held, 0 in chunk_ids, num_chunks - 1 in chunk_ids)
    parts = []
    for i in chunk_ids:
        part = stage_view(model, ranges[i], is_first=i == 0, is_last=i == num_chunks - 1)
        part.stage_index, part.pp_rank = i, i % pp_size
        parts.append(part)
    return parts


def _pipeline_loss(output: Any, target: torch.Tensor, task: TaskSpec, config: Any, num_items_in_batch: Any = None,
                   loss_scale: float = 1.0, last_stage: nn.Module | None = None, counted: bool = True) -> torch.Tensor:
    """Loss of one micro-batch on the last stage: the task's loss summed over the micro-batch's items and divided by
    the whole batch's ``num_items_in_batch``, plus the ``carried_loss`` of the state the stages carried (see
    :class:`PipelineStageMixin`), times ``loss_scale`` (a data-parallel engine that averages gradients over N ranks
    passes N). Several label tensors arrive stacked on the last dimension."""
    outputs = output if isinstance(output, tuple) else (output,)
    labels = target.unbind(-1) if len(task.label_names) > 1 else (target,)
    count = len(task.output_fields)
    loss = task.compute_loss(outputs[:count], labels, config, num_items_in_batch)
    extra = _carried_loss(last_stage, outputs[count:], labels, num_items_in_batch, counted)
    if extra is not None:
        loss = loss + extra
    return loss * loss_scale if loss_scale != 1.0 else loss


def _carried_loss(stage: nn.Module | None, carried: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                  num_items_in_batch: Any, counted: bool = True) -> torch.Tensor | None:
    """The last stage's model's loss from the carried state, or None. State it leaves out of the loss still
    joins the graph (times zero), so every carried tensor gets a gradient to send back."""
    if stage is None or not carried:
        return None
    extra = stage.carried_loss(dict(zip(carried_names(stage), carried)), tuple(labels), num_items_in_batch,
                               counted=counted)
    unused = sum(t.sum() * 0.0 for t in carried if t.requires_grad)
    return unused if extra is None else extra + unused


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor (tensor parallel, FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a DTensor (vocabulary-sharded logits), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# Schedules kept per (input shape, training or evaluation): torch fixes a stage's activation shapes when it first
# runs, so training and evaluation batches and a few sequence lengths of dynamically padded data each keep theirs.
MAX_CACHED_SCHEDULES = 8


class PipelineParallel:
    """This rank's share of a pipelined model and the schedules that run it.

    Build it with :func:`build_pipeline`. ``model_parts`` are the stage views this rank holds (one, or
    ``virtual_pipeline_stages`` for interleaved 1F1B); give their parameters to the optimizer. :meth:`step`
    runs forward and backward of a whole per-rank batch and returns the batch loss on every pipeline rank;
    calling the object runs forward only (evaluation) and returns the task's outputs (and loss, with labels) on
    every pipeline rank.

    Attributes:
        model_parts: this rank's stage views, in stage order.
        stage_ids: the pipeline stage index of each model part.
        task: the task whose loss the last stage computes.
        pp_group: the process group of this rank's pipeline.
        pp_rank: this rank's position in the pipeline.
        pp_size: number of pipeline ranks.
        micro_batches: micro-batches each batch is split into.
        has_first_stage, has_last_stage: whether this rank reads the model input / computes the loss.
    """

    def __init__(self, model_parts: list[nn.Module], stage_ids: list[int], num_stages: int,
                 parallel_config: ParallelConfig, pp_group: dist.ProcessGroup, device: torch.device,
                 tied_group: dist.ProcessGroup | None = None, tied_names: Sequence[str] = ()) -> None:
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.num_stages = num_stages
        self.task: TaskSpec = model_parts[0].pipeline_task
        self.config = model_parts[0].config
        self.pp_group = pp_group
        self.device = device
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.micro_batches = parallel_config.micro_batches
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        self.training = True
        self._schedule_cls = get_schedule_class(parallel_config.torch_schedule_name)
        self._vocab_parallel_loss = parallel_config.vocab_parallel
        self._tied_group = tied_group
        self._tied_names = list(tied_names)
        self._schedules: dict[tuple[Any, ...], Any] = {}
        # Loss calls still to come on placeholder tensors: a new training schedule's first step infers the gradient
        # shapes by running the stages and the loss once on empty tensors (torch's dynamic metadata inference).
        self._placeholder_losses = 0

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

    def _loss(self, output: Any, target: torch.Tensor, num_items_in_batch: Any = None,
              loss_scale: float = 1.0) -> torch.Tensor:
        counted = self._placeholder_losses == 0
        self._placeholder_losses = max(self._placeholder_losses - 1, 0)
        return _pipeline_loss(output, target, self.task, self.config, num_items_in_batch, loss_scale, self._last_part(),
                              counted)

    def _last_part(self) -> nn.Module | None:
        """The model part holding the last stage (None on other ranks)."""
        return self.model_parts[-1] if self.has_last_stage else None

    def _schedule_for(self, shape: tuple[int, ...], training: bool) -> Any:
        key = (*shape, training)
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            if len(self._schedules) >= MAX_CACHED_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            stages = [PipelineStage(part, i, self.num_stages, self.device, group=self.pp_group)
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
        if mask is not None and not bool(mask.all()):
            kwargs["attention_mask"] = mask
        if getattr(self.config, "is_encoder_decoder", False):
            if isinstance(batch.get("decoder_attention_mask"), torch.Tensor):
                kwargs["decoder_attention_mask"] = batch["decoder_attention_mask"]
            return ((inputs, self._decoder_inputs(batch)) if self.has_first_stage else ()), kwargs
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            kwargs[TOKEN_IDS_KEY] = ids
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

    def _target(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The batch's labels as one tensor (several label tensors stacked on a last dimension)."""
        labels = [batch[name] for name in self.task.label_names]
        return labels[0] if len(labels) == 1 else torch.stack(labels, dim=-1)

    def step(self, batch: Mapping[str, Any], num_items_in_batch: int | torch.Tensor | None = None,
             loss_scale: float = 1.0, sync_tied: bool = True) -> torch.Tensor:
        """Forward and backward of one per-rank batch (the model input, labels, optional ``attention_mask``), split
        into the configured micro-batches.

        Every rank of the pipeline passes the same batch (the first stage reads the model input, the last the
        labels). ``num_items_in_batch`` normalises the summed loss (HF's meaning); by default it is this batch's
        item count, which makes the loss the mean over items. ``loss_scale`` multiplies the loss before backward.
        Gradients accumulate into the parameters. ``sync_tied`` then sums the gradients of a tied embedding
        between the first and last stage: pass False for all but the last batch of an accumulation (a sum of
        already-summed gradients would count the earlier batches twice). Returns the backpropagated batch loss
        (detached) on every rank of the pipeline.
        """
        if num_items_in_batch is None:
            num_items_in_batch = max(self.task.count_items(batch) or 0, 1)
        args, kwargs = self._stage_inputs(batch)
        target = self._target(batch) if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        schedule = self._schedule_for(self._shape_key(batch), training=True)
        loss_kwargs = {"num_items_in_batch": num_items_in_batch, "loss_scale": loss_scale}
        # Vocabulary-sharded logits (a DTensor) need torch's parallel cross-entropy.
        with loss_parallel() if self._vocab_parallel_loss else contextlib.nullcontext():
            schedule.step(*args, target=target, losses=losses, loss_kwargs=loss_kwargs, **kwargs)
        total = torch.stack([_local(loss.detach()).float() for loss in losses]).sum() if losses \
            else torch.zeros((), device=self.device)
        # The loss is known on the last rank only; the caller logs it on every rank.
        dist.broadcast(total, group_src=self.pp_size - 1, group=self.pp_group)
        if sync_tied:
            self._sync_tied_grads()
        return total

    def forward_backward(self, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: int | torch.Tensor | None = None, loss_scale: float = 1.0) -> torch.Tensor:
        """:meth:`step` over each gradient-accumulation batch of one optimizer step; returns the summed loss.
        ``num_items_in_batch`` is the item count of the whole step, so the sum is the step's loss; by default it
        is counted from ``micro_batches``."""
        if num_items_in_batch is None:
            num_items_in_batch = max(sum(self.task.count_items(b) or 0 for b in micro_batches), 1)
        total = None
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            loss = self.step(batch, num_items_in_batch, loss_scale, sync_tied=i == last)
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
            fields["loss"] = self.task.compute_loss(outputs[:count], labels, self.config, num_items_in_batch)
            extra = _carried_loss(self.model_parts[0], outputs[count:], labels, num_items_in_batch)
            if extra is not None:  # the carried state came to every rank with the outputs
                fields["loss"] = fields["loss"] + extra
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
            for name in self._tied_names:
                param = params.get(name)
                if param is not None and param.grad is not None:
                    dist.all_reduce(_local(param.grad), group=self._tied_group)


def _tied_weight_names(model: nn.Module) -> list[str]:
    """Names of the weights the first and last stage would both hold (tied input/output embeddings)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return [*tied, *tied.values()] if isinstance(tied, Mapping) else list(tied)


def _pp_group(mesh: Any) -> dist.ProcessGroup:
    """The pipeline process group of ``mesh``: a :class:`~.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"``
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
    parallel_config: ParallelConfig,
    mesh: Any = None,
    device: torch.device | str | None = None,
    parallelize: Callable[[nn.Module], nn.Module | None] | None = None,
) -> PipelineParallel:
    """Cut ``model`` in place to this rank's stages and return them ready to run with torch's schedules.

    Args:
        model: a model of a task of the registry declaring a pipeline plan (``GPTForCausalLM``,
            ``GPTForSequenceClassification``, ...), with the same weights on every rank (same seed or same
            checkpoint). It is cut in place (:func:`cut_to_stages`): afterwards it holds exactly this rank's
            parameters under the full model's names.
        parallel_config: gives ``pipeline_stage``, ``virtual_pipeline_stages``, ``micro_batch_num``,
            ``pipeline_schedule`` (and, for the stages' inputs and the loss, sequence and vocabulary parallelism).
        mesh: the run's :class:`~.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"`` dimension or a 1-D
            pipeline mesh; None uses the whole world as the pipeline.
        device: where the stages run (default: the current CUDA device with NCCL, else CPU).
        parallelize: applied to each stage view (tensor parallel, recompute, data parallel / ZeRO, in
            torchtitan's order; ``part.pp_rank`` gives the stage for per-stage settings); it may return a wrapping
            module or modify the part in place and return None.
    """
    pp, vpp = parallel_config.pp, parallel_config.vpp
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
    model.to(device)
    parts: list[nn.Module] = []
    for part in split_model(model, num_chunks, chunk_ids, pp):
        part.sequence_shards = parallel_config.tp if parallel_config.sequence_parallel else 1
        if parallelize is not None:
            part = parallelize(part) or part
        parts.append(part)
    tied_group = _tied_group(group, pp_rank, pp) if tied_names else None
    return PipelineParallel(parts, chunk_ids, num_chunks, parallel_config, group, device, tied_group, tied_names)
