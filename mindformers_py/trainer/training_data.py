"""Where the Trainer's training data comes from: the default collator, the sequence length the layout is planned
for, the batches of one run (an epoch-ordered sampler over a map-style dataset, or a stream) with the run's length in
steps and epochs, and the data position a resumed run continues from."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

from torch import nn

from ..engine import Engine
from ..task_registry import TaskSpec
from .arguments import TrainingArguments
from .batching import EpochBatches, GlobalBatchSampler, StreamBatches, build_dataloader, is_stream
from .checkpoint import DataPosition

logger = logging.getLogger(__name__)


def default_collator(spec: TaskSpec | None, tokenizer: Any) -> Callable[[list[Any]], Any]:
    """The task's collator with ``tokenizer``; for a model of no known task, transformers' padding collator (or
    plain stacking without a tokenizer)."""
    if spec is not None and spec.collator is not None:
        return spec.collator(tokenizer)
    from transformers import DataCollatorWithPadding, default_data_collator

    has_pad = tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None
    return DataCollatorWithPadding(tokenizer) if has_pad else default_data_collator


def first_input_length(dataset: Any, model: nn.Module) -> int | None:
    """Length of the first training example's model input (what the ``auto_parallel`` planner plans for), else
    the model's context length."""
    if dataset is not None and not is_stream(dataset):
        try:
            first = dataset[0]
            ids = first.get("input_ids") if isinstance(first, Mapping) else None
            if ids is not None:
                return len(ids)
        except (TypeError, KeyError, IndexError, NotImplementedError):
            pass
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def training_source(dataset: Any, collate: Callable, args: TrainingArguments, engine: Engine, global_batch: int,
                    num_samples: int, data_seed: int) -> tuple[Any, int, float]:
    """The batches of a training run and its length: ``(source, max_steps, num_epochs)``. A stream (``num_samples``
    0, unknown) runs ``max_steps`` over endless passes; a map-style dataset of ``num_samples`` is read in a
    (data seed, epoch) order by global micro-batches of ``global_batch`` samples."""
    accum = args.gradient_accumulation_steps
    if is_stream(dataset):
        max_steps, num_epochs = args.max_steps, math.inf
        source: Any = StreamBatches(dataset, global_batch, engine.shard_indices, collate)
    else:
        # A dataset already in its training order (Megatron's shuffle index) is read in order, as Megatron does.
        sampler = GlobalBatchSampler(num_samples, global_batch, engine.shard_indices,
                                     shuffle=not getattr(dataset, "shuffled", False), seed=data_seed,
                                     drop_last=args.dataloader_drop_last, share=engine.batch_share)
        source = EpochBatches(sampler, build_dataloader(
            dataset, sampler, collate, args.dataloader_num_workers,
            args.dataloader_pin_memory and engine.device.type == "cuda", args.dataloader_prefetch_factor, data_seed))
        steps_per_epoch = math.ceil(source.batches_per_epoch / accum)
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        num_epochs = math.ceil(max_steps / steps_per_epoch)
    return source, max_steps, num_epochs


def resumed_position(saved: DataPosition, num_samples: int, global_batch: int, data_seed: int) -> DataPosition:
    """Where a resumed run continues: the saved epoch and samples consumed, with this run's data figures (a warning
    when they differ from the checkpoint's, since the skip of consumed samples is then approximate)."""
    # The order is a function of (data seed, epoch) and the position a number of samples: another data-parallel
    # size (or micro-batch split) resumes exactly where the samples consumed are whole micro-batches of it.
    if (saved.num_samples, saved.data_seed) != (num_samples, data_seed) or saved.samples_consumed % global_batch:
        logger.warning(
            "resuming with different data: the checkpoint was written with %d samples (%d of epoch %d consumed), "
            "global micro-batch %d, data seed %d; this run has %d, %d, %d, so the skip of consumed samples is "
            "approximate", saved.num_samples, saved.samples_consumed, saved.epoch, saved.global_batch_size,
            saved.data_seed, num_samples, global_batch, data_seed)
    return DataPosition(epoch=saved.epoch, samples_consumed=saved.samples_consumed, num_samples=num_samples,
                        global_batch_size=global_batch, data_seed=data_seed)
