"""A family's whole-state-dict converter, run once on shapes, then replayed one tensor at a time.

Each family converts an HF state dict to ours with one function over the whole dict (``state_dict_from_hf``): most
tensors are only renamed, a few are reshaped (GPT-2's transposed, fused q/k/v projection is split; MoE experts'
per-expert tensors are stacked). Loading a large checkpoint must not hold the whole dict in memory, and a rank that
holds a shard must not read more than its part, yet the converter stays the one place that knows the mapping.

So the converter runs on ``meta`` tensors (shapes and dtypes from the checkpoint's headers, no data) under a
``TorchFunctionMode`` that records, for every tensor it creates, the torch call that made it. An output that *is* one
of the inputs is a plain rename (:class:`Renamed`): it is read directly (a slice of it only, when a rank holds a
slice). Any other output (:class:`Derived`) is recomputed from its recorded calls on the real tensors when it is
loaded, one output at a time. A call that needs values to decide (``torch.equal``, ``bool(tensor)``: T5 compares its
head with its embedding to decide whether they are tied) is run on the real tensors during the trace.

A rank that holds a block of a derived tensor (an expert-parallel rank: its experts of a stacked expert weight;
under tensor parallelism, a slice of each) asks for that block alone (:meth:`ConversionTrace.fill_block`): the block
is pushed back through the recorded calls that only move data (``stack``, ``cat``, ``chunk``, ``split``,
``contiguous``, ``clone``) to the blocks of the checkpoint tensors it comes from, and only those are read. Experts are
most of a mixture-of-experts checkpoint's bytes, so each rank reads about its share of the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..checkpoint.reader import CheckpointReader

# Calls whose result depends on the values, not only the shapes: run on the real tensors while tracing.
_VALUE_CALLS = {torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.Tensor.item,
                torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                torch.Tensor.numpy}


@dataclasses.dataclass(frozen=True)
class Renamed:
    """Our tensor is the checkpoint's tensor ``key`` as stored."""

    key: str


@dataclasses.dataclass(frozen=True)
class Derived:
    """Our tensor is computed from checkpoint tensors by the recorded calls (see :meth:`ConversionTrace.value`)."""

    node: int


@dataclasses.dataclass
class _Call:
    func: Callable[..., Any]
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A tensor argument of a recorded call: the id of a traced tensor."""

    node: int


class _Recorder(TorchFunctionMode):
    """Records each torch call on traced tensors; runs value-dependent calls on the real ones."""

    def __init__(self, trace: "ConversionTrace") -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self.trace
        if func in _VALUE_CALLS:
            real = lambda x: trace._real(id(x)) if isinstance(x, torch.Tensor) and id(x) in trace._known else x
            return func(*tree_map(real, args), **tree_map(real, kwargs))
        out = func(*args, **kwargs)
        if not _touches(args, kwargs, trace._known):
            return out
        call = _Call(func, _template(args, trace._known), _template(kwargs, trace._known))
        for path, tensor in _tensors_in(out):
            if id(tensor) not in trace._known:
                trace._record(tensor, call, path)
        return out


def _touches(args: Any, kwargs: Any, known: dict[int, Any]) -> bool:
    found = False

    def visit(x):
        nonlocal found
        found = found or (isinstance(x, torch.Tensor) and id(x) in known)
        return x

    tree_map(visit, (args, kwargs))
    return found


def _template(value: Any, known: dict[int, Any]) -> Any:
    return tree_map(lambda x: _Ref(id(x)) if isinstance(x, torch.Tensor) and id(x) in known else x, value)


def _tensors_in(out: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [((), out)]
    if isinstance(out, (tuple, list)):
        return [((i,), t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    return []


class ConversionTrace:
    """Where each of our tensors comes from in a checkpoint, by a converter traced on the checkpoint's shapes.

    Args:
        reader: the checkpoint (its headers give the shapes; values are read only for value-dependent calls).
        convert: ``state_dict -> state_dict`` (the family's ``state_dict_from_hf`` with its config bound), or None
            for a checkpoint already in our names.

    Attributes:
        sources: our key -> :class:`Renamed` or :class:`Derived`, in the converter's output order.
        shapes: our key -> shape.
        dtypes: our key -> the stored dtype it is computed in.
    """

    def __init__(self, reader: CheckpointReader, convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None) -> None:
        self.reader = reader
        self._known: dict[int, tuple[_Call, tuple[int, ...]] | str] = {}
        self._alive: dict[int, torch.Tensor] = {}  # keeps traced tensors alive (so their ids stay unique), by id
        inputs = {key: reader.meta_tensor(key) for key in reader.keys()}
        for key, tensor in inputs.items():
            self._known[id(tensor)] = key
            self._alive[id(tensor)] = tensor
        if convert is None:
            outputs = inputs
        else:
            with _Recorder(self):
                outputs = convert(dict(inputs))
        self.sources: dict[str, Renamed | Derived] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for key, tensor in outputs.items():
            if tensor is None:
                continue
            node = self._known.get(id(tensor))
            self.sources[key] = Renamed(node) if isinstance(node, str) else Derived(id(tensor))
            self.shapes[key] = tuple(tensor.shape)
            self.dtypes[key] = tensor.dtype

    def _record(self, tensor: torch.Tensor, call: _Call, path: tuple[int, ...]) -> None:
        self._known[id(tensor)] = (call, path)
        self._alive[id(tensor)] = tensor

    def _real(self, node: int, memo: dict[int, Any] | None = None) -> torch.Tensor:
        """The real value of traced tensor ``node``: a checkpoint view, or its recorded call replayed."""
        entry = self._known[node]
        if isinstance(entry, str):
            return self.reader.tensor(entry)
        memo = {} if memo is None else memo
        call, path = entry
        if id(call) not in memo:
            resolve = lambda x: self._real(x.node, memo) if isinstance(x, _Ref) else x
            memo[id(call)] = call.func(*tree_map(resolve, call.args), **tree_map(resolve, call.kwargs))
        out = memo[id(call)]
        for i in path:
            out = out[i]
        return out

    def value(self, key: str) -> torch.Tensor:
        """Our tensor ``key`` (CPU, in its stored dtype): a view of the file for a rename, else computed now."""
        source = self.sources[key]
        if isinstance(source, Renamed):
            return self.reader.tensor(source.key)
        with torch.no_grad():
            return self._real(source.node)

    def fill_block(self, key: str, out: torch.Tensor, offset: tuple[int, ...]) -> bool:
        """Write the block of our tensor ``key`` that starts at ``offset`` and has ``out``'s shape into ``out``,
        reading only the checkpoint bytes it comes from; returns False (writing nothing) when a call on its way
        is not one that merely moves data, so the block cannot be traced back (then load the whole value)."""
        source = self.sources[key]
        if isinstance(source, Renamed):
            pieces = [(source.key, tuple(offset), tuple(out.shape), ())]
        else:
            pieces = self._pieces(source.node, tuple(offset), tuple(out.shape), ())
        if pieces is None:
            return False
        with torch.no_grad():
            for name, start, shape, where in pieces:
                target = out
                for index in where:  # the piece's place in the block, one call's indexing at a time
                    target = target[index]
                whole_rows = all(o == 0 and n == full for o, n, full in
                                 zip(start[1:], shape[1:], self.reader.shape(name)[1:]))
                if whole_rows and target.is_contiguous() and target.dtype == self.reader.dtype(name) and target.dim():
                    self.reader.read_rows(name, start[0], target)  # plain file reads, no page mapped
                    continue
                block = self.reader.tensor(name)
                for dim, (o, n) in enumerate(zip(start, shape)):
                    block = block.narrow(dim, o, n)
                target.copy_(block)
        return True

    def _pieces(self, node: int, offset: tuple[int, ...], shape: tuple[int, ...],
                where: tuple) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple]] | None:
        """The checkpoint blocks (name, offset, shape, where) that make the block ``offset``/``shape`` of traced tensor
        ``node``, ``where`` the indexings that lead from the requested block to the piece's place; None when a call
        on the way does more than move data."""
        entry = self._known[node]
        if isinstance(entry, str):
            return [(entry, offset, shape, where)]
        call, path = entry
        func, args, kwargs = call.func, call.args, call.kwargs
        if func in (torch.Tensor.contiguous, torch.Tensor.clone) and isinstance(args[0], _Ref) and not path:
            return self._pieces(args[0].node, offset, shape, where)
        if func in (torch.stack, torch.cat) and not path:
            parts = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if not all(isinstance(p, _Ref) for p in parts) or not isinstance(dim, int):
                return None
            dim %= len(shape)
            out: list = []
            begin = 0
            for part in parts:
                size = 1 if func is torch.stack else self._alive[part.node].shape[dim]
                lo, hi = max(offset[dim], begin), min(offset[dim] + shape[dim], begin + size)
                if lo < hi:
                    if func is torch.stack:  # one index of the new dimension: the part's block, without that dimension
                        sub_offset, sub_shape = offset[:dim] + offset[dim + 1:], shape[:dim] + shape[dim + 1:]
                        index = where + ((slice(None),) * dim + (lo - offset[dim],),)
                    else:
                        sub_offset = offset[:dim] + (lo - begin,) + offset[dim + 1:]
                        sub_shape = shape[:dim] + (hi - lo,) + shape[dim + 1:]
                        index = where + ((slice(None),) * dim + (slice(lo - offset[dim], hi - offset[dim]),),)
                    found = self._pieces(part.node, sub_offset, sub_shape, index)
                    if found is None:
                        return None
                    out += found
                begin += size
            return out
        if func in (torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split) and len(path) == 1 \
                and isinstance(args[0], _Ref):
            source = self._alive[args[0].node]
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % source.dim()
            count = kwargs.get("chunks", kwargs.get("split_size_or_sections", args[1] if len(args) > 1 else None))
            if func in (torch.Tensor.chunk, torch.chunk):
                if not isinstance(count, int):
                    return None
                size = -(-source.shape[dim] // count)
                starts = [i * size for i in range(count)]
            elif isinstance(count, int):
                starts = list(range(0, source.shape[dim], count))
            else:
                starts = [sum(count[:i]) for i in range(len(count))]
            start = starts[path[0]]
            moved = offset[:dim] + (offset[dim] + start,) + offset[dim + 1:]
            return self._pieces(args[0].node, moved, shape, where)
        return None

    def is_renamed(self, key: str) -> bool:
        """Whether our tensor ``key`` is a checkpoint tensor as stored (so a slice of it can be read alone)."""
        return isinstance(self.sources.get(key), Renamed)
