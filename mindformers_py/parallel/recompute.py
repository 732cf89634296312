"""Activation recomputation (checkpointing) with torch's checkpoint wrappers, chosen by :class:`RecomputeConfig`.

* ``full``: each chosen transformer layer is wrapped in ``checkpoint_wrapper`` (non-reentrant): only its input
  is kept for backward, and its forward is re-run there.
* ``selective``: only the parts named in ``select_recompute`` are re-run: ``attention_core`` (the
  softmax(q kᵀ)v of :func:`mindformers_py.layers.attention_core`, whose intermediates grow with the square of the
  sequence; the layer's :meth:`Attention.core` is replaced by a ``torch.utils.checkpoint`` call of it),
  ``self_attn`` or ``mlp`` (those sub-blocks wrapped in ``checkpoint_wrapper``).
* every-N-layers: ``recompute_num_layers`` limits either mode to the first N layers of each pipeline stage.

Checkpointing preserves the RNG state, so dropout masks are the same in the re-run. The wrappers add
``_checkpoint_wrapped_module`` to parameter names; torch's state-dict hooks (and DCP) remove it again, so
checkpoints do not depend on recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from ..layers import Attention, attention_core
from ..layers.latent_attention import LatentAttention
from ..errors import ConfigError
from .config import RecomputeConfig
from .recompute_config import SELECT_RECOMPUTE_CHOICES
from .data import layer_modules


def _checkpointed_attention_core(*args, **kwargs):
    return checkpoint(attention_core, *args, use_reentrant=False, **kwargs)


def _checkpointed(core: Callable, context_fn: Callable | None, *args, **kwargs):
    return checkpoint(core, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _wrap_child(parent: nn.Module, name: str, context_fn: Callable | None = None) -> None:
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    setattr(parent, name, checkpoint_wrapper(getattr(parent, name), **extra))


def _parents(model: nn.Module, targets: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of each module in ``targets``, in the order of ``targets``."""
    where = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            where.setdefault(id(child), (parent, name))
    return [where[id(t)] for t in targets]


def apply_recompute(model: nn.Module, recompute: RecomputeConfig, stage: int = 0,
                    context_fn: Callable | None = None) -> nn.Module:
    """Apply ``recompute`` to ``model``'s transformer layers in place; returns ``model``.

    ``model`` may be a whole model or one pipeline stage (``stage`` its index, for per-stage layer counts);
    layers are counted from 0 within it. Apply after tensor (and context) parallelism and before data parallelism.
    ``context_fn`` is torch checkpointing's (two context managers, for the forward and its recomputation): context
    parallelism passes one so a recomputed attention sees the sequence of the forward pass it repeats. An attention
    core that context parallelism replaced is the one recomputed.
    """
    if not recompute.enabled:
        return model
    layers = layer_modules(model)
    chosen = [layer for i, layer in enumerate(layers) if recompute.recomputes_layer(i, stage)]
    if recompute.recompute == "full":
        for parent, name in _parents(model, chosen):
            _wrap_child(parent, name, context_fn)
        return model
    for layer in chosen:
        for part in recompute.select_recompute:
            if part == "attention_core":
                attentions = [m for m in layer.modules() if isinstance(m, (Attention, LatentAttention))]
                if not attentions:
                    raise ConfigError(
                        f"recompute.select_recompute='attention_core' is not valid for {type(layer).__name__}: it "
                        f"holds no {Attention.__module__}.Attention whose core could be recomputed; choose one of: "
                        f"{', '.join(repr(n) for n, c in layer.named_children() if n in SELECT_RECOMPUTE_CHOICES)}"
                        " or recompute='full'")
                for module in attentions:
                    replaced = module.__dict__.get("core")  # context parallelism's, else the layer's own
                    module.core = _checkpointed_attention_core if replaced is None and context_fn is None \
                        else functools.partial(_checkpointed, replaced or attention_core, context_fn)
            elif isinstance(getattr(layer, part, None), nn.Module):
                _wrap_child(layer, part, context_fn)
            else:
                raise ConfigError(f"recompute.select_recompute={part!r} is not valid for {type(layer).__name__}: it has "
                                  f"no submodule {part!r}; its submodules: {', '.join(n for n, _ in layer.named_children())}")
    return model
