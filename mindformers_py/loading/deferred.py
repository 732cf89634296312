"""Models whose weights are filled after they are built: on ``meta`` first, then each tensor (or only this rank's
shard of it) from the checkpoint or the model's own init, one at a time.

:func:`build_empty` builds a model with its parameters on the ``meta`` device (no memory, no random init; buffers
such as rotary frequencies are computed as usual, they are small) and tags every module with its name in the model,
which survives what a layout does to the modules (peft's wrapping, recompute's wrapper, pipeline cuts, DTensor
parameters). The model carries a :class:`DeferredWeights` record saying where each parameter comes from.

:func:`materialize` fills the model's ``meta`` parameters where they now live:

* a parameter that is an ordinary tensor gets its whole value: a checkpoint tensor already in the right dtype on the
  CPU stays a view of the memory-mapped file (no copy, as transformers loads), anything else is converted or
  computed one tensor at a time;
* a parameter that is a DTensor (tensor, expert or FSDP2 sharding) gets only this rank's slice of the value:
  renamed checkpoint tensors are sliced before a byte is read, so a rank reads only its part; a tensor the converter
  assembles (stacked experts) is traced back to the checkpoint tensors its slice comes from, so an expert-parallel
  rank reads only its own experts;
* a parameter the checkpoint lacks (a preset, a new head) is initialised by the model's own ``_init_weights`` on its
  module, whole, under a seed derived from the record's seed and the module's name, then sliced: every layout gets
  the values stand-alone gets, whatever the order or the rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import MindFormersError
from ..checkpoint.reader import CheckpointReader
from .conversion_trace import ConversionTrace

NAME_ATTR = "_mf_module_name"
"""Attribute holding a module's qualified name in the model it was built in."""
RECORD_ATTR = "_deferred_weights"
"""Attribute of the model (the root module it was built as) holding its :class:`DeferredWeights`."""
TIED_ATTR = "_mf_tied_sources"
"""Attribute of the model: a tied weight's name in its other places -> (the module that owns it, attribute). Kept
so a pipeline stage holding only the other place (a head tied to the first stage's embedding) initialises it as
the owner's init does, the module kept alive here though the stage dropped it."""


@dataclasses.dataclass
class DeferredWeights:
    """Where each parameter of a model built by :func:`build_empty` gets its value.

    Attributes:
        folder: the checkpoint folder (safetensors), or None when every parameter is initialised.
        from_hf: the checkpoint holds an HF architecture's tensors, converted by the family's converter.
        sources: parameter name in the model -> name of the (converted) checkpoint tensor that fills it; the other
            parameters are initialised.
        seed: the seed every module's init seed derives from (drawn from torch's global generator when the model
            was built, so ``torch.manual_seed`` decides it as it decides a model built eagerly).
        dtype: the dtype parameters get (None: a checkpoint tensor keeps its stored dtype; initialised ones float32).
        keep_fp32: names of modules (last name part) whose parameters stay float32 (transformers'
            ``_keep_in_fp32_modules`` rules).
    """

    folder: str | None
    from_hf: bool
    sources: dict[str, str]
    seed: int
    dtype: torch.dtype | None = None
    keep_fp32: tuple[str, ...] = ()

    def dtype_of(self, name: str, stored: torch.dtype | None) -> torch.dtype:
        """The dtype parameter ``name`` gets (``stored``: its checkpoint dtype, None when initialised)."""
        if self.keep_fp32 and any(part in self.keep_fp32 for part in name.split(".")[:-1]):
            return torch.float32
        if self.dtype is not None:
            return self.dtype
        return stored if stored is not None and stored.is_floating_point else torch.float32


_ORIGINS: "weakref.WeakKeyDictionary[nn.Module, tuple[DeferredWeights, dict[str, tuple]]]" = weakref.WeakKeyDictionary()
"""Models filled whole by :func:`materialize` -> (their record, each parameter's object, version and dtype then), to
tell later whether they still hold exactly what the record describes."""


def unchanged_record(model: nn.Module) -> DeferredWeights | None:
    """The record ``model`` was filled from, when every parameter still is that value (same object, never written
    in place, same dtype): it can then be rebuilt elsewhere from the record alone. None otherwise."""
    origin = _ORIGINS.get(model)
    if origin is None:
        return None
    record, then = origin
    now = {name: param for name, _, _, param in _param_names(model)}
    if set(now) != set(then):
        return None
    for name, param in now.items():
        ref, version, dtype = then[name]
        if ref() is not param or param.is_inference() or param._version != version or param.dtype != dtype:
            return None  # (an inference tensor put in by hand keeps no version counter: not the record's value)
    return record


def meta_parameter(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> nn.Parameter:
    """A parameter without a value (what a model's parameter becomes when it is sent to be filled elsewhere)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)


def draw_seed() -> int:
    """A seed for a model's inits, drawn from torch's global (CPU) generator, whatever the default device is."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def module_seed(seed: int, module_name: str) -> int:
    """The init seed of the module called ``module_name`` (stable across processes and Python runs)."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


_DEFERRING = threading.local()


@contextlib.contextmanager
def deferred_loading() -> Iterator[None]:
    """Within this block, ``from_pretrained`` (of our Auto and model classes) returns models whose parameters are
    still on the ``meta`` device: a Trainer's layout then fills only each rank's shards (:func:`materialize`), so no
    process of a sharded run ever holds the whole model. The recipe runner and the Trainer's workers load this way;
    a script under ``torchrun`` can too::

        with deferred_loading():
            model = AutoModelForCausalLM.from_pretrained(folder)
        Trainer(model=model, args=args_with_a_layout, ...).train()
    """
    before = getattr(_DEFERRING, "on", False)
    _DEFERRING.on = True
    try:
        yield
    finally:
        _DEFERRING.on = before


def loading_is_deferred() -> bool:
    """Whether :func:`deferred_loading` is in force in this thread."""
    return getattr(_DEFERRING, "on", False)


def build_empty(model_class: type[nn.Module], config: Any) -> nn.Module:
    """``model_class(config)`` with every parameter on the ``meta`` device and every module tagged with its name; no
    init runs (buffers, computed by the modules themselves, are real)."""
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    # Outside inference mode (a script may load inside torch.inference_mode()): the model's tensors are ordinary
    # ones, which keep version counters and can be trained later, as transformers' loaded weights can.
    with torch.inference_mode(False):
        with init_empty_weights(include_buffers=False), no_init_weights():
            model = model_class(config)
        model.tie_weights()  # skipped with the inits; tied parameters are then one object, filled once
    tag_module_names(model)
    model.__dict__[TIED_ATTR] = {f"{module.__dict__[NAME_ATTR]}.{attr}".lstrip("."): group[0]
                                 for group in _holders(model) for module, attr in group[1:]}
    return model


def tag_module_names(model: nn.Module) -> None:
    """Tag each module of ``model`` with its qualified name (kept when a layout wraps or cuts the model)."""
    for name, module in model.named_modules(remove_duplicate=False):
        module.__dict__.setdefault(NAME_ATTR, name)


def deferred_record(model: nn.Module) -> DeferredWeights | None:
    """The :class:`DeferredWeights` of ``model`` or of the model inside it (a peft model's base, a pipeline stage)."""
    for module in model.modules():
        record = module.__dict__.get(RECORD_ATTR)
        if record is not None:
            return record
    return None


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` has no value yet."""
    return any(p.is_meta for p in model.parameters())


def give_record(model: nn.Module, record: DeferredWeights, stored: dict[str, torch.dtype] | None = None) -> None:
    """Attach ``record`` to ``model`` (built by :func:`build_empty`) and give its ``meta`` parameters the dtypes they
    will be loaded in (``stored``: the checkpoint dtype of each loaded parameter), so what is planned or wrapped
    before loading (a layout, peft's adapters, which follow their base layer's dtype) sees the final dtypes."""
    model.__dict__[RECORD_ATTR] = record
    stored = stored or {}
    for name, _, _, param in _param_names(model):
        dtype = record.dtype_of(name, stored.get(name))
        if param.is_meta and param.dtype != dtype:
            torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, dtype=dtype),
                                                         requires_grad=param.requires_grad))


def _param_names(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """(name in the built model, owner module, attribute name, parameter) of each parameter once (tied ones once)."""
    seen: set[int] = set()
    for module in model.modules():
        prefix = module.__dict__.get(NAME_ATTR)
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if prefix is None:  # a module added after the model was built (an adapter): not the record's
                continue
            yield (f"{prefix}.{attr}" if prefix else attr), module, attr, param


def _holders(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place (tied weights)."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                places[id(param)].append((module, attr))
    return [group for group in places.values() if len(group) > 1]


def _checkpoint_trace(record: DeferredWeights, config: Any) -> tuple[CheckpointReader, ConversionTrace]:
    from ..models import registry

    reader = CheckpointReader(record.folder)
    convert = None
    if record.from_hf:
        family = registry.family_for_model_type(config.model_type)
        settled = copy.deepcopy(config)  # the converter may settle fields (T5's tying); the model's are settled
        convert = lambda state: family.converter.state_dict_from_hf(state, settled)
    return reader, ConversionTrace(reader, convert)


def _init_model_of(root: nn.Module, module_name: str) -> nn.Module:
    """The innermost ``PreTrainedModel`` above the module called ``module_name`` (whose ``_init_weights`` applies,
    as transformers dispatches inits to sub-models)."""
    from transformers import PreTrainedModel

    best = root
    for module in root.modules():
        name = module.__dict__.get(NAME_ATTR)
        if isinstance(module, PreTrainedModel) and name is not None and \
                (name == "" or module_name == name or module_name.startswith(name + ".")):
            if len(name) >= len(best.__dict__.get(NAME_ATTR, "")):
                best = module
    return best


def _initialised(root: nn.Module, module: nn.Module, module_name: str, wanted: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 record: DeferredWeights, device: torch.device) -> dict[str, torch.Tensor]:
    """Whole values of ``module``'s parameters ``wanted`` (attribute -> shape, dtype), from the model's init of the
    module under the module's own seed. The module's other parameters stand in as ``meta`` tensors, so an init
    touching them changes nothing."""
    originals = dict(module._parameters)
    temporary = {}
    for attr, param in originals.items():
        if param is None:
            continue
        shape, dtype = wanted.get(attr, (tuple(param.shape), param.dtype))
        where = device if attr in wanted else torch.device("meta")
        temporary[attr] = nn.Parameter(torch.empty(shape, dtype=dtype, device=where), requires_grad=param.requires_grad)
    # Only the generator of the device the values are drawn on is seeded (and restored afterwards).
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        module._parameters.update(temporary)
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            seed = module_seed(record.seed, module_name)
            (torch.cuda.default_generators[cuda[0]] if cuda else torch.default_generator).manual_seed(seed)
            _init_model_of(root, module_name)._init_weights(module)
    finally:
        module._parameters.update(originals)
    return {attr: temporary[attr].detach() for attr in wanted}


def materialize(model: nn.Module, device: torch.device | str | Callable[[str], torch.device] | None = None) -> nn.Module:
    """Give every ``meta`` parameter of ``model`` its value (see the module docstring); returns ``model``.

    ``device``: where the parameters are (ordinary ones: one device, or a function of the parameter's name for a
    device map); DTensor parameters stay on their mesh's device. Buffers on another device are moved there too.
    A model without ``meta`` parameters is returned as it is."""
    record = deferred_record(model)
    if record is None or not has_meta_parameters(model):
        return model
    with torch.inference_mode(False):  # ordinary tensors, also when loading inside torch.inference_mode()
        return _materialize(model, record, device)


def _materialize(model: nn.Module, record: DeferredWeights,
                 device: torch.device | str | Callable[[str], torch.device] | None) -> nn.Module:
    root = next(m for m in model.modules() if m.__dict__.get(RECORD_ATTR) is record)
    place = device if callable(device) else (lambda name, d=torch.device(device or "cpu"): torch.device(d))
    pending = [(name, module, attr, param) for name, module, attr, param in _param_names(model) if param.is_meta]
    known = {id(entry[3]) for entry in pending}
    orphan = next((name for name, p in model.named_parameters() if p.is_meta and id(p) not in known), None)
    if orphan is not None:  # added on meta after the model was built: nothing says where its value comes from
        raise MindFormersError(f"{orphan} has no value and is not one of the loaded model's weights (a module added "
                               "on the meta device after loading); add it to a model whose weights are loaded")
    sharded = any(isinstance(p, DTensor) for *_, p in pending)
    if sharded:  # allocate the local shards where FSDP2/DTensor expect them, keeping what already has values
        mesh_device = next(p for *_, p in pending if isinstance(p, DTensor)).device_mesh.device_type
        holders = _holders(model)
        model._apply(lambda t: torch.empty_like(t, device=mesh_device) if t.is_meta else t.to(mesh_device))
        for group in holders:  # _apply gives each module a new parameter object: tie them again
            first = group[0][0]._parameters[group[0][1]]
            for module, attr in group[1:]:
                module._parameters[attr] = first
        pending = [(name, module, attr, module._parameters[attr]) for name, module, attr, _ in pending]
    # parameters held by several modules (tied weights): each keeps the object it shares
    shared = {(id(module), attr) for group in holders if len(group) > 1 for module, attr in group} if sharded else set()
    reader, trace = _checkpoint_trace(record, root.config) if record.folder else (None, None)
    tied = root.__dict__.get(TIED_ATTR, {})
    try:
        by_module: dict[int, list] = defaultdict(list)
        with torch.no_grad():
            for entry in pending:
                name = entry[0]
                if name in record.sources and trace is not None:
                    key = record.sources[name]
                    if sharded and (id(entry[1]), entry[2]) not in shared and _map_own_rows(entry, trace, key):
                        continue
                    if sharded and _read_own_rows(entry[3], trace, key):
                        continue
                    if sharded and _read_own_block(entry[3], trace, key):
                        reader.close()  # unmap the pages read for this block
                        continue
                    if not sharded and _read_assembled(entry, trace, key, place(name)):
                        continue
                    _fill(entry, lambda key=key: trace.value(key), place(name))
                    if sharded:  # unmap the file now: the pages read for this slice stop counting as this process's
                        reader.close()
                elif name in tied:
                    by_module[id(entry)].append(entry)  # alone: its owner's other weights are not held here
                else:
                    by_module[id(entry[1])].append(entry)
            for entries in by_module.values():
                module, attrs = entries[0][1], [entry[2] for entry in entries]
                if entries[0][0] in tied:  # held here as a tied copy: drawn by the module that owns it
                    module, attrs = tied[entries[0][0]][0], [tied[entries[0][0]][1]]
                wanted = {attr: (tuple(entry[3].shape), entry[3].dtype) for attr, entry in zip(attrs, entries)}
                init_device = place(entries[0][0]) if not sharded else torch.device(mesh_device)
                values = _initialised(root, module, module.__dict__[NAME_ATTR], wanted, record, init_device)
                for attr, entry in zip(attrs, entries):
                    _fill(entry, lambda v=values[attr]: v, init_device)
    finally:
        if reader is not None:
            reader.close()
    if not sharded:
        _ORIGINS[root] = (record, {name: (weakref.ref(param), param._version, param.dtype)
                                   for name, _, _, param in _param_names(root)})
    for module in model.modules():  # buffers (computed on the CPU when built) join the parameters
        for attr, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                name = f"{module.__dict__.get(NAME_ATTR, '')}.{attr}"
                target = place(name) if not sharded else torch.device(mesh_device)
                if name in record.sources and trace is not None:
                    # a persistent buffer the checkpoint holds (DeepSeek-V3's e_score_correction_bias): its value,
                    # in the dtype its module built it in (a float32 selection bias stays float32 in a bf16 model,
                    # as transformers keeps it)
                    module._buffers[attr] = trace.value(record.sources[name]).to(target, buffer.dtype).clone()
                    continue
                dtype = record.dtype_of(name, buffer.dtype) if buffer.is_floating_point() and record.dtype else buffer.dtype
                if buffer.device != target or buffer.dtype != dtype:
                    module._buffers[attr] = buffer.to(target, dtype)
    return model


def _read_own_rows(param: torch.Tensor, trace: ConversionTrace, key: str) -> bool:
    """Fill the DTensor ``param`` by reading only its own rows of checkpoint tensor ``key`` straight from the file,
    when it is a stored tensor renamed, held in its stored dtype, and this rank's part is a run of whole rows (a
    replica, or a shard along the first dimension: FSDP2's, a column-parallel or vocabulary-parallel weight); returns
    whether it did. No page of the file is mapped and nothing beyond the shard is allocated."""
    rows = _own_rows(param, trace, key)
    if rows is None:
        return False
    trace.reader.read_rows(trace.sources[key].key, rows[0], param.to_local())
    return True


# Meshes whose DTensor parameters no FSDP2 unit manages (tensor parallelism's; the batch mesh a frozen head is split
# over, "dp" or "dp_cp"): a parameter there may take a new local tensor. FSDP2 keeps its own references to the shards
# it manages (its meshes are "dp_shard", "dp_shard_cp", "dp_replicate").
_UNMANAGED_MESH_DIMS = frozenset({"tp", "dp", "dp_cp"})


def _map_own_rows(entry: tuple, trace: ConversionTrace, key: str) -> bool:
    """Give a frozen DTensor parameter, whose part is a run of whole rows of checkpoint tensor ``key`` (as
    :func:`_read_own_rows` reads them), a view of those rows in the mapped file as its local tensor; returns whether
    it did. As a frozen whole table stays a view of the file, nothing is read until touched: the rows of a
    vocabulary-parallel embedding shard that no step looks up never become resident (a frozen shard read into
    memory was 0.29 GiB a rank at Qwen3's vocabulary under tp2)."""
    _, module, attr, param = entry
    if not isinstance(param, DTensor) or param.requires_grad or \
            not set(param.device_mesh.mesh_dim_names or ("?",)) <= _UNMANAGED_MESH_DIMS:
        return False
    rows = _own_rows(param, trace, key)
    if rows is None:
        return False
    start, count = rows
    view = trace.value(key).narrow(0, start, count)
    local = DTensor.from_local(view, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                               stride=param.stride())
    module._parameters[attr] = nn.Parameter(local, requires_grad=False)
    return True


def _own_rows(param: torch.Tensor, trace: ConversionTrace, key: str) -> tuple[int, int] | None:
    """(first row, rows) of the DTensor ``param``'s part of checkpoint tensor ``key``, when ``key`` is a stored
    tensor renamed, held in its stored dtype on the CPU, and the part is a run of whole rows; else None."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor) or not trace.is_renamed(key) or not all(
            type(p) in (Shard, Replicate) for p in param.placements):
        return None
    local = param.to_local()
    if local.dtype != trace.reader.dtype(trace.sources[key].key) or local.device.type != "cpu" or \
            not local.is_contiguous() or local.dim() == 0:
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(o != 0 or n != full for o, n, full in zip(offset[1:], shape[1:], param.shape[1:])):
        return None
    return offset[0], shape[0]


def _read_assembled(entry: tuple, trace: ConversionTrace, key: str, device: torch.device) -> bool:
    """Fill an ordinary CPU parameter that the converter assembles from several checkpoint tensors (stacked
    experts) by reading those tensors straight into it (:meth:`ConversionTrace.fill_block`): one copy, and no page of
    the files mapped; returns whether it did."""
    name, module, attr, param = entry
    if trace.is_renamed(key) or device.type != "cpu" or tuple(trace.shapes[key]) != tuple(param.shape):
        return False
    value = torch.empty(param.shape, dtype=param.dtype)
    if not trace.fill_block(key, value, (0,) * value.dim()):
        return False
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    return True


def _read_own_block(param: torch.Tensor, trace: ConversionTrace, key: str) -> bool:
    """Fill the DTensor ``param`` with its own block of our tensor ``key`` read from just the checkpoint tensors (or
    parts of them) it comes from (see :meth:`ConversionTrace.fill_block`): an expert-parallel rank's experts of a
    stacked expert weight, from their per-expert tensors; returns whether it did."""
    if not isinstance(param, DTensor):
        return False
    local = param.to_local()
    offset = _block_offset(param)
    if local.device.type != "cpu" or offset is None:
        return False
    return trace.fill_block(key, local, offset)


def _block_offset(param: DTensor) -> tuple[int, ...] | None:
    """Where this rank's part of ``param`` starts in the whole tensor, when the part is one block (a run of indices
    along each dimension); None otherwise. Found by torch's own placement rules applied to the indices of each
    dimension (no communication): FSDP2 over expert-parallel shards is a ``_StridedShard`` whose parts are blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import placement_types

    sharding = (Shard, getattr(placement_types, "_StridedShard", Shard))  # (private in torch 2.13)
    local_shape = param.to_local().shape
    offset = []
    for dim, size in enumerate(param.shape):
        placements = [p if isinstance(p, sharding) and p.dim == dim else Replicate() for p in param.placements]
        index = torch.arange(size).view([1] * dim + [size] + [1] * (param.dim() - dim - 1))
        held = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local().flatten()
        if held.numel() != local_shape[dim] or (held.numel() and not torch.equal(
                held, torch.arange(int(held[0]), int(held[0]) + held.numel()))):
            return None
        offset.append(int(held[0]) if held.numel() else 0)
    return tuple(offset)


def local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole value of the DTensor ``param``), sliced where ``full`` lies: nothing
    is moved to the mesh's device but the part, and of a view of a mapped file only the part's pages are read."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if all(type(p) in (Shard, Replicate) for p in param.placements):
        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        part = full
        for dim, (start, length) in enumerate(zip(offset, shape)):
            if length != full.shape[dim]:
                part = part.narrow(dim, start, length)
        return part
    # other placements (FSDP2 over tensor-parallel shards: strided) by torch's own rule, without communication
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _fill(entry: tuple, value: Callable[[], torch.Tensor], device: torch.device) -> None:
    """Give one parameter its value: the whole tensor for an ordinary parameter (a checkpoint view in the right dtype
    on the CPU kept as it is), this rank's part for a DTensor."""
    name, module, attr, param = entry
    full = value()
    if isinstance(param, DTensor):
        param.to_local().copy_(local_part(full, param))
        return
    if tuple(full.shape) != tuple(param.shape):
        raise RuntimeError(f"{name}: value of shape {tuple(full.shape)} for a parameter of shape {tuple(param.shape)}")
    new = full.to(device=device, dtype=param.dtype)
    torch.utils.swap_tensors(param, nn.Parameter(new, requires_grad=param.requires_grad))
