"""The recipe runner sends the layout it resolved to the ranks it launches (in their environment); a rank that
received one runs it as it is, and one started without it resolves its own."""

from __future__ import annotations

import os

import pytest

from mindformers_py.errors import ConfigError
from mindformers_py.launcher.launch import TORCHRUN_ENV
from mindformers_py.parallel import ParallelConfig
from mindformers_py.recipes.layout_handover import LAYOUT_ENV, layout_was_sent, received_layout, sending_layout


def test_a_launched_rank_receives_the_layout_resolved_by_its_launcher(monkeypatch):
    layout = ParallelConfig(parallel_mode="semi_auto_parallel", model_parallel=2).resolve(2)
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with sending_layout(layout):
        sent = os.environ[LAYOUT_ENV]
        assert not layout_was_sent() and received_layout(2) is None  # the launcher itself is not a rank
    assert LAYOUT_ENV not in os.environ  # only the ranks started inside the context get it
    monkeypatch.setenv(LAYOUT_ENV, sent)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    for name in TORCHRUN_ENV:  # whatever else torchrun sets
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    assert layout_was_sent() and received_layout(2) == layout
    with pytest.raises(ConfigError, match=f"^{LAYOUT_ENV} holds a layout resolved for world_size=2, but this run has 4"):
        received_layout(4)
