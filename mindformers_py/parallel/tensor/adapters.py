"""Tensor parallelism of peft's LoRA layers: each adapter is sharded the way its base layer is, as Megatron-LM shards
LoRA, with torch's own parallel styles.

peft replaces an adapted projection ``q_proj`` by a layer holding the original as ``q_proj.base_layer`` and the
adapter as ``q_proj.lora_A.<name>`` (``in -> r``) and ``q_proj.lora_B.<name>`` (``r -> out``); its forward adds
``lora_B(lora_A(x)) * scaling`` to the base layer's output. The plan's style for ``q_proj`` is applied to
``base_layer``, and the adapter so that the sum of the two is formed from tensors sharded alike:

===============  ========================================================  =======================================
base layer       ``lora_A`` (in -> r)                                      ``lora_B`` (r -> out)
===============  ========================================================  =======================================
``colwise``      whole on every rank: its input is the replicated ``x``    ``colwise``: each rank makes its output
                                                                           slice; the backward all-reduces
                                                                           ``lora_A``'s output gradient
``colwise_rep``  whole on every rank                                       ``colwise_rep``: each rank makes its
                                                                           output slice, the slices all-gathered
``rowwise``      ``rowwise``: each rank contracts its input slice, the r   whole on every rank (with sequence
                 outputs are all-reduced (reduce-scattered over the        parallelism, ``SequenceParallel``: its
                 sequence with sequence parallelism)                       weight gradient is summed over the
                                                                           sequence shards)
===============  ========================================================  =======================================

Other adapters on a sharded layer (IA3, LoHa, DoRA's magnitude, LoRA on a vocabulary-parallel embedding or head,
...) are refused in one line naming the module rather than trained on the wrong shapes.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ...errors import ConfigError

__all__ = ["adapted_model", "adapter_styles", "is_peft_model"]


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a peft model (``PeftModel`` or one of its task classes, possibly wrapped by FSDP): it
    holds its configs in ``peft_config`` and the model its adapters were injected into behind ``get_base_model``."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(model, "get_base_model", None))


def adapted_model(model: nn.Module) -> nn.Module:
    """The model the adapters were injected into (a peft model's base model, which holds the LoRA layers under its
    own module names, the names the tp and pp plans use), or ``model`` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def _is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft layer wrapping a base layer (``base_layer``)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def _plain_lora(module: nn.Module) -> bool:
    """A LoRA layer over an ``nn.Linear`` with only the plain low-rank update (no DoRA or other variant)."""
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    return (isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict) and len(lora_a) > 0
            and isinstance(module.base_layer, nn.Linear)
            and not len(getattr(module, "lora_magnitude_vector", None) or {})
            and not getattr(module, "lora_variant", None)
            and all(isinstance(m, nn.Linear) for m in (*lora_a.values(), *lora_b.values())))


def _kind(style: ParallelStyle) -> str | None:
    """``colwise``, ``colwise_rep`` or ``rowwise`` for the plan's plain projection styles (replicated in, sharded
    out / replicated in, gathered out / sharded in, reduced out), None for the vocabulary-parallel ones and the
    others."""
    if isinstance(style, ColwiseParallel) and style.input_layouts == (Replicate(),) and style.use_local_output:
        if style.output_layouts == (Shard(-1),):
            return "colwise"
        if style.output_layouts == (Replicate(),):
            return "colwise_rep"
    if isinstance(style, RowwiseParallel) and style.input_layouts == (Shard(-1),) and style.use_local_output:
        return "rowwise"
    return None


def adapter_styles(model: nn.Module, styles: Mapping[str, ParallelStyle], *, tp: int) -> dict[str, ParallelStyle]:
    """``styles`` (module name -> torch style, from the model's tp plan) with every style that lands on a peft layer
    moved to its base layer and its LoRA matrices (see the module docstring); ``tp`` is for messages."""
    out: dict[str, ParallelStyle] = {}
    for name, style in styles.items():
        module = model.get_submodule(name)
        if not _is_tuner_layer(module):
            out[name] = style
            continue
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):  # a layout hook on the module's input
            out[name] = style
            continue
        kind = _kind(style)
        if kind is None or not _plain_lora(module):
            parts = type(module).__module__.split(".")
            what = parts[2] if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else type(module).__name__
            raise ConfigError(
                f"model_parallel={tp} cannot shard peft's {what} adapter on {name} (a {kind or 'vocabulary-parallel'} "
                "layer): tensor parallelism shards plain LoRA (no DoRA) on the column- and row-parallel projections; "
                "target other modules or use model_parallel=1")
        out[f"{name}.base_layer"] = style
        sequence_out = style.output_layouts == (Shard(1),)
        for adapter in module.lora_A:
            if kind == "colwise":
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            elif kind == "colwise_rep":
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel(output_layouts=Replicate())
            else:
                out[f"{name}.lora_A.{adapter}"] = RowwiseParallel(output_layouts=style.output_layouts[0])
                if sequence_out:
                    out[f"{name}.lora_B.{adapter}"] = SequenceParallel(use_local_output=True)
    return out
