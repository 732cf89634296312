"""Parameter and module names as state dicts write them.

Recompute wraps layers in torch's checkpoint wrapper, which adds a ``_checkpoint_wrapped_module.`` level to the
names ``named_parameters`` / ``named_modules`` give; torch's state-dict hooks (and DCP) take it out again, so saved
weights, optimizer groups and adapters do not depend on recompute. Code that matches a live name against a saved one
(or against a name taken before the layout wrapped the model) strips it with :func:`state_name`.
"""

from __future__ import annotations

CHECKPOINT_WRAPPER_LEVEL = "_checkpoint_wrapped_module."
"""The name level torch's ``checkpoint_wrapper`` adds (torch keeps it as a private constant)."""


def state_name(name: str) -> str:
    """``name`` (of a parameter, buffer or module) without the checkpoint wrapper's levels: its state-dict name."""
    return name.replace(CHECKPOINT_WRAPPER_LEVEL, "")
