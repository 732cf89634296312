"""The resolved layout handed from the process that launches a recipe's ranks to the ranks.

The launching process resolves the recipe's ``parallel`` section once, against the world, the model and the batch
(:meth:`ParallelConfig.resolve <mindformers_py.parallel.config.ParallelConfig.resolve>`), before it starts them; the
ranks get the :class:`~mindformers_py.parallel.layout.Layout` itself (in their environment, as JSON) and run it
without checking it again. A rank started by a user's own ``torchrun`` gets none and resolves the recipe's layout
itself, once.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from ..errors import ConfigError
from ..launcher.launch import launched_by_torchrun
from ..parallel.layout import Layout

LAYOUT_ENV = "MINDFORMERS_PY_LAYOUT"
"""The environment variable that carries the resolved layout to the launched ranks."""


@contextlib.contextmanager
def sending_layout(layout: Layout | None) -> Iterator[None]:
    """The ranks started inside this context receive ``layout`` (nothing when None)."""
    if layout is None:
        yield
        return
    previous = os.environ.get(LAYOUT_ENV)
    os.environ[LAYOUT_ENV] = json.dumps(layout.to_dict())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAYOUT_ENV, None)
        else:
            os.environ[LAYOUT_ENV] = previous


def layout_was_sent() -> bool:
    """Whether this process is a rank that received its layout from the process that launched it."""
    return launched_by_torchrun() and LAYOUT_ENV in os.environ


def received_layout(world_size: int) -> Layout | None:
    """The layout this rank received (None when it was not sent one: it resolves its own)."""
    if not layout_was_sent():
        return None
    layout = Layout.from_dict(json.loads(os.environ[LAYOUT_ENV]))
    if layout.world_size != world_size:
        raise ConfigError(f"{LAYOUT_ENV} holds a layout resolved for world_size={layout.world_size}, but this run has "
                          f"{world_size} processes; unset {LAYOUT_ENV} (the launcher sets it for the ranks it starts)")
    return layout
