"""``Layout``: what ``ParallelConfig.resolve`` returns, frozen, equal however often it is resolved, sent to other
processes as plain values; the one-line errors of a bad layout are the ``validate_for`` ones (test_parallel_config)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import Layout, ParallelConfig

MODEL = mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                     max_position_embeddings=16)


def _layout() -> tuple[ParallelConfig, Layout]:
    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=2, model_parallel=2, pipeline_stage=2,
                            micro_batch_num=4, optimizer_shard=3, use_seq_parallel=True, recompute="selective")
    return config, config.resolve(8, MODEL, per_device_batch=4, task="causal_lm")


def test_layout_holds_the_degrees_applied_and_is_frozen():
    config, layout = _layout()
    assert (layout.world_size, layout.dp, layout.tp, layout.pp, layout.cp, layout.ep) == (8, 2, 2, 2, 1, 1)
    assert (layout.micro_batches, layout.zero_stage, layout.data_parallel_engine) == (4, 3, "fsdp")
    assert layout.sequence_parallel and not layout.vocab_parallel
    assert layout.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and layout.mesh_shape == (2, 1, 2, 1, 2)
    assert layout.describe() == config.describe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4
    config.recompute.recompute = False  # the user's config changed afterwards: the resolved layout is not
    assert layout.recompute.recompute == "selective"


def test_resolving_twice_gives_equal_layouts_and_the_mode_decides_the_degrees():
    config, layout = _layout()
    assert config.resolve(8, MODEL, per_device_batch=4, task="causal_lm") == layout
    # stand_alone keeps a YAML's layout sizes but applies none of them
    alone = ParallelConfig(data_parallel=2, model_parallel=2).resolve(1)
    assert (alone.parallel_mode, alone.dp, alone.tp, alone.world_size) == ("stand_alone", 1, 1, 1)


def test_a_bad_layout_gives_the_one_line_errors_of_validate_for():
    config = ParallelConfig(parallel_mode="semi_auto_parallel", model_parallel=3)
    for check in (config.resolve, config.validate_for):
        with pytest.raises(ConfigError) as err:
            check(3, MODEL)
        assert str(err.value) == "model_parallel=3 does not divide the model's num_attention_heads=4; choose one of: 1, 2, 4"
        with pytest.raises(ConfigError, match=r"^data_parallel\*model_parallel\*pipeline_stage = 1\*3\*1 = 3 does not "
                                              r"match world_size=2"):
            check(2)


def test_a_layout_travels_as_plain_values():
    _, layout = _layout()
    planned = dataclasses.replace(layout, plan_summary="chose dp=2 tp=2 pp=2")
    back = Layout.from_dict(json.loads(json.dumps(planned.to_dict())))
    assert back == planned and back.plan_summary == planned.plan_summary and back.describe() == layout.describe()


def test_a_configs_derived_degrees_follow_its_fields():
    """``config.tp`` and the other derived degrees are read once per config (the planner reads thousands), and read
    again after a field is set, whatever the field."""
    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=2, model_parallel=2)
    assert (config.dp, config.tp, config.zero_stage, config.data_parallel_engine) == (2, 2, 0, "replicate")
    config.model_parallel = 4
    config.optimizer_shard = 3
    assert (config.dp, config.tp, config.zero_stage, config.data_parallel_engine) == (2, 4, 3, "fsdp")
    config.parallel_mode = "stand_alone"
    assert (config.dp, config.tp, config.data_parallel_engine) == (1, 1, "none")
    copied = dataclasses.replace(config, parallel_mode="semi_auto_parallel")
    assert (copied.dp, copied.tp, config.tp) == (2, 4, 1)
