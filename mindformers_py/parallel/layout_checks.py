"""The checks of a layout against a run (the world size, a model config, the batch), run once per process by
:meth:`ParallelConfig.resolve <.config.ParallelConfig.resolve>` on the :class:`~.layout.Layout` it is about to return.

Every refusal is one line naming the user's field (``model_parallel``, not ``tp``), its value and what would be
valid. The checks of the config on its own (types, ranges, modes, micro-batches, expert parallel dividing data
parallel) are :meth:`ParallelConfig.validate <.config.ParallelConfig.validate>`'s.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..layers.moe.config import expert_count, moe_config_of
from ..utils.config_section import _divisors, _to_int
from .context.checks import validate_context_model
from .layout import Layout


def _processes(count: int) -> str:
    """How to start ``count`` processes, for an error's fix."""
    return f"{count} processes (torchrun --nproc_per_node {count}, or mindformers-py run without torchrun)"


def check_world(config: Any, layout: Layout) -> None:
    """Refuse a layout its mode cannot run on ``layout.world_size`` processes (``config``: the user's
    :class:`~.config.ParallelConfig`, whose fields the messages name)."""
    world_size, mode = layout.world_size, layout.parallel_mode
    if mode == "stand_alone" and world_size != 1:
        raise ConfigError(
            f"parallel_mode='stand_alone' is not valid with world_size={world_size} (it runs one process); "
            "choose one of: 'data_parallel', 'semi_auto_parallel', 'auto_parallel'"
        )
    if mode == "data_parallel" and config.data_parallel != world_size:
        raise ConfigError(
            f"data_parallel={config.data_parallel} does not match world_size={world_size}; "
            f"expected data_parallel={world_size} with parallel_mode='data_parallel', or run "
            f"{_processes(config.data_parallel)}"
        )
    required = layout.required_world_size()
    if mode == "semi_auto_parallel" and required != world_size:
        cp = "*context_parallel" if layout.cp > 1 else ""
        cp_size = f"*{layout.cp}" if layout.cp > 1 else ""
        others = layout.cp * layout.tp * layout.pp
        borrowed = layout.cp  # expert ranks are borrowed from data x context parallel ranks
        fits = world_size % others == 0 and (world_size // others * borrowed) % layout.ep == 0
        fix = f"set data_parallel={world_size // others}" if fits else "change the layout"
        raise ConfigError(
            f"data_parallel{cp}*model_parallel*pipeline_stage = {layout.dp}{cp_size}*{layout.tp}*"
            f"{layout.pp} = {required} does not match world_size={world_size}; run "
            f"{_processes(required)}, or {fix}"
        )


def check_run(layout: Layout, model_config: Any = None, per_device_batch: int | None = None,
              global_batch: int | None = None, *, task: str | None = None, sequence_length: int | None = None) -> None:
    """The checks of ``layout`` against the model config (when given: :func:`check_model`) and the batch sizes
    (:func:`check_batch`). :meth:`ParallelConfig.resolve <.config.ParallelConfig.resolve>` runs them; a run that
    resolves its layout before the model is final (the recipe runner, before its data sets ``num_labels`` or the
    vocabulary) runs them once the model is."""
    if model_config is not None:
        check_model(layout, model_config, task=task, sequence_length=sequence_length)
    check_batch(layout, per_device_batch, global_batch)


def check_model(layout: Layout, cfg: Any, task: str | None = None, sequence_length: int | None = None) -> None:
    """Refuse a layout the model config ``cfg`` cannot be split by: heads, FFN, experts and (sharded) vocabulary
    against ``tp``, layers against the pipeline's chunks, experts against ``ep``, and context parallelism against
    the heads, the task and ``sequence_length`` (:func:`~.context.checks.validate_context_model`)."""
    tp = layout.tp
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    sharded = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
               "intermediate_size": getattr(cfg, "intermediate_size", None)}
    moe = moe_config_of(cfg)
    if moe is not None:  # tensor parallelism splits routed and shared experts like the MLP
        sharded["moe_config.moe_intermediate_size"] = moe.expert_size(cfg.intermediate_size)
        if moe.shared_expert_num:
            sharded["moe_config.shared_expert_intermediate_size"] = moe.shared_expert_size(cfg.intermediate_size)
    if layout.vocab_parallel:
        sharded["vocab_size"] = getattr(cfg, "vocab_size", None)
    sharded = {k: v for k, v in sharded.items() if isinstance(v, int)}
    for name, size in sharded.items():
        if size % tp:
            allowed = _divisors(math.gcd(*sharded.values()))
            raise ConfigError(
                f"model_parallel={tp} does not divide the model's {name}={size}; "
                f"choose one of: {', '.join(map(str, allowed))}"
            )
    tokens = getattr(cfg, "fixed_sequence_length", None)  # models whose every input has this many tokens (ViT)
    if layout.sequence_parallel and isinstance(tokens, int) and tokens % tp:
        raise ConfigError(
            f"use_seq_parallel=True splits the model's {tokens} tokens per sample over model_parallel={tp} ranks, "
            f"which does not divide them; choose a model_parallel dividing {tokens}, another image_size/patch_size, "
            "or use_seq_parallel=False")
    num_layers = getattr(cfg, "num_hidden_layers", None)
    if getattr(cfg, "is_encoder_decoder", False) and isinstance(getattr(cfg, "num_decoder_layers", None), int):
        num_layers += cfg.num_decoder_layers  # the stages split the encoder's layers, then the decoder's
    chunks = layout.pp * layout.vpp
    if isinstance(num_layers, int) and num_layers < chunks:
        what = f"pipeline_stage*virtual_pipeline_stages = {layout.pp}*{layout.vpp} = " if layout.vpp > 1 \
            else "pipeline_stage="
        raise ConfigError(
            f"{what}{chunks} is not valid for num_hidden_layers={num_layers}; "
            f"expected at most {num_layers} model chunks (each needs a layer)"
        )
    if getattr(cfg, "builds_mtp", False) and layout.sequence_parallel:
        # GPTConfig.use_mtp: each MTP module reads the main stack's hidden states and the embedding of the tokens
        # ahead, whole sequences, where sequence parallelism would hand it a slice of the sequence
        raise ConfigError(f"use_seq_parallel=True is not supported with multi-token prediction (use_mtp=True, "
                          f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}): its modules read whole "
                          "sequences; set use_seq_parallel=False or use_mtp=False")
    if getattr(cfg, "builds_mtp", False) and layout.cp > 1 and layout.pp > 1:
        # the last stage takes the MTP loss from labels aligned with the inputs, which a rank's chunks are not
        raise ConfigError(f"context_parallel={layout.cp} with pipeline_stage={layout.pp} is not supported with "
                          f"multi-token prediction (use_mtp=True, num_nextn_predict_layers="
                          f"{cfg.num_nextn_predict_layers}); set context_parallel=1, pipeline_stage=1 or use_mtp=False")
    experts, source = expert_count(cfg)
    if experts is None and layout.ep > 1:
        raise ConfigError(f"expert_parallel={layout.ep} is not valid for a model without experts (a dense model); "
                          "expected expert_parallel=1, or a model with experts (MoE)")
    if experts is not None and experts % layout.ep:
        raise ConfigError(
            f"expert_parallel={layout.ep} does not divide the model's {source}={experts}; choose one of: "
            f"{', '.join(str(d) for d in _divisors(experts) if (layout.dp * layout.cp) % d == 0)}"
        )
    if experts is not None and layout.sequence_parallel:
        raise ConfigError("use_seq_parallel=True is not supported for a model with experts (MoE): the router "
                          "statistics need whole sequences on each rank; set use_seq_parallel=false")
    validate_context_model(layout, cfg, task=task, sequence_length=sequence_length)


def check_batch(layout: Layout, per_device_batch: int | None, global_batch: int | None) -> None:
    """Refuse batch sizes the pipeline's micro-batches (and, for ``global_batch``, the data-parallel ranks) do not
    divide."""
    if per_device_batch is not None:
        per_device_batch = _to_int("per_device_train_batch_size", per_device_batch)
        if per_device_batch % layout.micro_batches:
            raise ConfigError(
                f"per_device_train_batch_size={per_device_batch} is not divisible by micro_batch_num="
                f"{layout.micro_batches}; "
                f"expected a multiple of {layout.micro_batches} (pipeline micro-batches split each rank's batch)"
            )
    if global_batch is not None:
        global_batch = _to_int("global_batch", global_batch)
        unit = layout.dp * layout.micro_batches
        if global_batch % unit:
            raise ConfigError(
                f"global_batch={global_batch} is not divisible by data_parallel*micro_batch_num = "
                f"{layout.dp}*{layout.micro_batches} = {unit}; expected a multiple of {unit}"
            )
