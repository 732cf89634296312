"""Worker functions of ``test_layout_loading.py`` (importable by the spawned gloo processes)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from mindformers_py.loading import deferred_loading
from mindformers_py.parallel import ParallelConfig
from mindformers_py.trainer.arguments import TrainingArguments

WRAPPER = "_checkpoint_wrapped_module."


def layout(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", micro_batch_num=2, **fields)


def held_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """(every parameter this rank holds, whole (gathered from its shards) by its name in the built model; the number
    of values this rank holds itself)."""
    out, local = {}, 0
    for name, param in model.named_parameters():
        name = name.replace(WRAPPER, "")
        if isinstance(param, DTensor):
            local += param.to_local().numel()
            out[name] = param.full_tensor().detach().clone()
        else:
            local += param.numel()
            out[name] = param.detach().clone()
    return out, local


def mapped_shards(model: torch.nn.Module) -> set[str]:
    """The DTensor parameters whose local part is a view into a larger storage (the checkpoint file's mapping)
    rather than a tensor of its own."""
    return {name.replace(WRAPPER, "") for name, param in model.named_parameters() if isinstance(param, DTensor)
            and param.to_local().untyped_storage().nbytes() > param.to_local().numel() * param.element_size()}


def load_under_layouts(rank: int, world_size: int, source: str, task: str, layouts: dict[str, dict],
                       overrides: dict | None = None) -> dict[str, tuple[dict[str, torch.Tensor], int, bool, set]]:
    """For each named layout: load ``source`` (a checkpoint folder or a preset, seed 0) deferred, let the layout's
    engine fill its shards (``frozen: True`` among a layout's fields: the model frozen first); returns (whole weights
    this rank holds, values it holds itself, whether the model was still all on meta before the engine filled it, the
    checkpoint tensors whose values this rank read, the sharded parameters left views of the file's mapping)."""
    from mindformers_py.checkpoint.reader import CheckpointReader

    read: set[str] = set()
    view, rows = CheckpointReader.tensor, CheckpointReader.read_rows

    def tensor(self, key):
        read.add(key)
        return view(self, key)

    def read_rows(self, key, start, out):
        read.add(key)
        return rows(self, key, start, out)

    CheckpointReader.tensor, CheckpointReader.read_rows = tensor, read_rows  # this worker process only
    try:
        return _load_each(source, task, layouts, overrides, read)
    finally:
        CheckpointReader.tensor, CheckpointReader.read_rows = view, rows


def load_sources_under_layouts(rank: int, world_size: int, sources: dict[str, str], task: str,
                               layouts: dict[str, dict]) -> dict[str, dict]:
    """:func:`load_under_layouts` for each named source, in one launch."""
    return {kind: load_under_layouts(rank, world_size, source, task, layouts) for kind, source in sources.items()}


def _load_each(source: str, task: str, layouts: dict[str, dict], overrides: dict | None, read: set[str]) -> dict:
    from mindformers_py.auto import auto_class_for
    from mindformers_py.engine import build_engine

    results = {}
    for name, fields in layouts.items():
        read.clear()
        fields = dict(fields)
        frozen = fields.pop("frozen", False)  # an adapter's base: nothing trains
        parallel = layout(**fields)
        torch.manual_seed(0)
        with deferred_loading():
            model = auto_class_for(task).from_pretrained(source, **(overrides or {}))
        if frozen:
            model.requires_grad_(False)
        all_meta = all(p.is_meta for p in model.parameters())
        args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, use_cpu=True,
                                 parallel_config=parallel, report_to=[], bf16=False)
        engine = build_engine(parallel, args)
        engine.setup()
        prepared = engine.prepare_model(model)
        parts = getattr(prepared, "model_parts", [prepared])
        weights, local = {}, 0
        for part in parts:
            held, count = held_weights(part)
            weights.update(held)
            local += count
        results[name] = (weights, local, all_meta, set(read), mapped_shards(prepared))
        engine.teardown()
    return results
