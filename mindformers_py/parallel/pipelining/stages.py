"""Pipeline stages: a model cut into stages by layers, each a module torch's ``PipelineStage`` can call.

**The model is its own stage** (torchtitan's way). The cut follows the plans the model declares
(``config.base_model_pp_plan`` and the head's ``_pp_plan``): modules listed before ``layers`` (token and position
embeddings) live on the first stage, ``layers`` is split into contiguous ranges, and modules listed after it (final
norm, head) live on the last stage, where the loss is computed. A stage is the model itself with the parts
it does not hold set to None: its own ``forward`` skips them (a base model without ``embed_tokens`` takes the
previous stage's hidden states as ``inputs_embeds``; a head model without its head returns the base output). No
stage code repeats the model's forward.

:func:`cut_to_stages` cuts the model in place to what a rank holds (its layers under their original indices, the
embeddings / norm and head only on the first / last stage), so the model keeps the full model's parameter names and
holds exactly that rank's parameters. Each stage the rank runs is a :func:`stage_view` of the cut model: a shallow
copy sharing its modules, holding one stage's layers, whose class adds :class:`PipelineStageMixin` so torch's
``PipelineStage`` can call it with tensors and receive tensors.

An encoder-decoder declares two stacks in its plan, in order (``encoder.layers`` then ``decoder.layers``): the
stages split the encoder's layers then the decoder's, the modules listed between the stacks (the encoder's final
norm) live on the stage of the encoder's last layer, and the activations handed between stages are tuples (see
:class:`EncoderDecoderStageMixin`): the encoder's output travels with the decoder's hidden states to every
decoder stage, which all attend to it.

**Extra loss state travels with the hidden states.** A model may name, in ``pipeline_carry``, base-model outputs
that later stages need (an MoE model's per-layer router statistics, from which the router loss is computed): each
stage then takes them as keyword arguments and returns them beside its hidden states (torch's ``PipelineStage``
sends every tensor of a tuple on, and their gradients back), and the last stage adds the model's ``carried_loss``
(see :mod:`mindformers_py.parallel.pipelining.schedule`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ...errors import ConfigError

class StageTask(Protocol):
    """What the stages need to know of the task they train: the engine passes its task registry entry
    (:class:`~mindformers_py.task_registry.TaskSpec`); without one, the model's own (its ``task_spec``)."""

    model_input: str
    """The batch key the first stage reads (``input_ids``, ``pixel_values``)."""
    label_names: tuple[str, ...]
    """Batch keys holding the labels, in the order the loss takes them."""
    output_fields: tuple[str, ...]
    """The model output fields the last stage returns (``logits``; ``start_logits``, ``end_logits``)."""
    output_class: type
    """The model output class those fields are presented in."""

    def outputs_of(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The :attr:`output_fields` of a model output."""

    def compute_loss(self, outputs: Any, labels: Any, config: Any, num_items_in_batch: Any = None,
                     labels_shifted: bool = False) -> torch.Tensor:
        """The task's loss of ``outputs`` against ``labels``, normalised by ``num_items_in_batch``; ``labels_shifted``:
        a causal LM's labels come already shifted (``shift_labels``)."""

    def count_items(self, batch: Mapping[str, Any]) -> int | None:
        """Items of the task's loss in ``batch``."""


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
    copies = set(last_stage_copies(model))  # read before the head (the modules needing them) goes
    held, start = set(slots), 0
    for stack, size, after in zip(plan.stacks, sizes, plan.after):
        owner, name = _owner(base, stack)
        layers = _indexed_layers(getattr(owner, name))
        setattr(owner, name, LayerSlice({str(i): layers[i] for i in range(size) if start + i in held}))
        _keep(base, after, start + size - 1 in held)
        start += size
    _keep(base, [path for path in plan.first if path not in copies], is_first)
    _keep(base, [path for path in plan.first if path in copies], is_first or is_last)
    if copies and is_last and not is_first:  # the copy serves the head; the stage's input is hidden states
        base.embeds_inputs = False
    _keep(model, plan.head, is_last)
    model._pipeline_stack_sizes = sizes


def last_stage_copies(model: nn.Module) -> tuple[str, ...]:
    """Modules of the first stage (paths in the base model) that the last stage holds a copy of, as ``model``
    declares in ``pipeline_last_stage_copies`` (a DeepSeek-V3 model's embedding, read by its multi-token
    prediction); their gradients are summed over the copies like a tied embedding's."""
    return tuple(getattr(model, "pipeline_last_stage_copies", ()) or ())


def pipeline_outputs(model: nn.Module) -> tuple[str, ...]:
    """The names of the outputs the last stage returns after the task's and the carried state (a model's
    ``pipeline_outputs``, read from its output's attributes of those names and given to its ``carried_loss``)."""
    if not callable(getattr(model, "carried_loss", None)):
        return ()
    return tuple(getattr(model, "pipeline_outputs", ()) or ())


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
    ``pipeline_task`` (the :class:`StageTask`) and ``sequence_shards`` (the
    tensor-parallel size under sequence parallelism: the hidden states a later stage receives are that many times
    shorter than the sequence, which positions and masks must cover).

    With carried state (the model's ``pipeline_carry`` names), ``carried`` are the previous stage's tensors of
    those names (none on the first stage), and every stage returns them after its hidden states (the last stage:
    after the task's outputs). The last stage then returns the model's :func:`pipeline_outputs` (asked for with
    ``return_<name>=True``).
    """

    def forward(self, inputs: torch.Tensor, *carried: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        spec: StageTask = self.pipeline_task
        names = carried_names(self)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": False}
        extra = pipeline_outputs(self) if self.is_last else ()
        kwargs.update({f"return_{name}": True for name in extra})
        if position_ids is not None:  # the batch's own (a context-parallel rank's chunks of the sequence)
            kwargs["position_ids"] = position_ids
        if self.is_first:  # else the model numbers the positions itself (RoBERTa's count only real tokens)
            kwargs[spec.model_input] = inputs
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
        else:
            length = inputs.shape[1] * self.sequence_shards
            if position_ids is None:
                kwargs["position_ids"] = torch.arange(length, device=inputs.device)[None]
            kwargs["inputs_embeds"] = inputs
            kwargs.update(zip(names, carried))
            if token_ids is not None:
                kwargs["input_ids"] = token_ids
        out = super().forward(**kwargs)
        state = tuple(out[name] for name in names)
        if not self.is_last:
            return (out.last_hidden_state, *state) if state else out.last_hidden_state
        fields = (*spec.outputs_of(out), *state, *(getattr(out, name) for name in extra))
        return fields[0] if len(fields) == 1 else fields


def carried_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the tensors ``model`` carries from pipeline stage to stage besides its hidden states (its
    ``pipeline_carry``; needs a ``carried_loss`` to use them on the last stage)."""
    if not callable(getattr(model, "carried_loss", None)):
        return ()
    return tuple(getattr(model, "pipeline_carry", ()) or ())


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


def stage_view(model: nn.Module, layers: range, is_first: bool, is_last: bool, task: StageTask | None = None) -> nn.Module:
    """One stage of ``model`` (cut by :func:`cut_to_stages` or whole) as a module torch's schedules can run: a
    shallow copy sharing the model's modules (no weight is copied), holding ``layers`` and, on the first / last
    stage, the embeddings / norm and head (see :class:`PipelineStageMixin`). Its state-dict keys are the full
    model's. ``task`` is what the stage computes (the engine gives its task); None takes the model's own
    ``task_spec``."""
    plan = stage_plan(model)  # refuses a model without a pipeline plan
    task = task or getattr(model, "task_spec", None)
    if task is None:
        raise ConfigError(f"pipeline_stage > 1 needs the task {type(model).__name__} trains: it names none (no "
                          "task_spec); train it with the Trainer, or pass task= (a task registry entry)")
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


def split_model(model: nn.Module, num_chunks: int, chunk_ids: list[int], pp_size: int = 1,
                task: StageTask | None = None) -> list[nn.Module]:
    """Cut ``model`` in place to the chunks ``chunk_ids`` of ``num_chunks`` (:func:`layer_ranges`; chunk ``i``
    runs on pipeline rank ``i % pp_size``) and return their stage views (computing ``task``, see
    :func:`stage_view`), in order."""
    ranges = layer_ranges(sum(stack_sizes(model)), num_chunks)
    held = [i for chunk in chunk_ids for i in ranges[chunk]]
    cut_to_stages(model, held, 0 in chunk_ids, num_chunks - 1 in chunk_ids)
    parts = []
    for i in chunk_ids:
        part = stage_view(model, ranges[i], is_first=i == 0, is_last=i == num_chunks - 1, task=task)
        part.stage_index, part.pp_rank = i, i % pp_size
        parts.append(part)
    return parts
