"""ParallelConfig / RecomputeConfig / MoEConfig: construction, coercion, round trips and every validation path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from mindformers_py.errors import ConfigError
from mindformers_py.parallel import MoEConfig, ParallelConfig, RecomputeConfig
from mindformers_py.parallel.config import PARALLEL_MODES, PIPELINE_SCHEDULES, SELECT_RECOMPUTE_CHOICES


def config_error(fn, *fragments: str) -> str:
    """Run ``fn``, expect a one-line ConfigError containing every fragment, return the message."""
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def semi(**kw) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", **kw)


def model(**kw) -> SimpleNamespace:
    """A model config with the attribute names validate_for reads."""
    base = dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64, vocab_size=100,
                num_hidden_layers=4)
    return SimpleNamespace(**{**base, **kw})


# --- defaults, construction, round trips ---------------------------------------------------------------------


def test_defaults_are_one_process():
    cfg = ParallelConfig()
    assert cfg.parallel_mode == "stand_alone"
    assert (cfg.data_parallel, cfg.model_parallel, cfg.pipeline_stage, cfg.expert_parallel) == (1, 1, 1, 1)
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.ep, cfg.vpp, cfg.micro_batches, cfg.zero_stage) == (1, 1, 1, 1, 1, 1, 0)
    assert cfg.required_world_size() == 1 and not cfg.is_distributed
    assert cfg.recompute == RecomputeConfig() and not cfg.recompute.enabled
    cfg.validate_for(1, model(), per_device_batch=3, global_batch=3)


def test_from_dict_none_gives_defaults():
    assert ParallelConfig.from_dict(None) == ParallelConfig()


def test_to_dict_round_trips_through_yaml():
    cfg = semi(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=4,
               pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2, expert_parallel=2,
               optimizer_shard=3, use_seq_parallel=True, vocab_emb_dp=False, recompute=[2, 1])
    text = yaml.safe_dump(cfg.to_dict())
    data = yaml.safe_load(text)
    assert data["recompute"] == {"recompute": "full", "select_recompute": ["attention_core"],
                                 "recompute_num_layers": [2, 1]}
    assert ParallelConfig.from_dict(data) == cfg
    moe = MoEConfig(expert_num=8, num_experts_chosen=2, routing_policy="dropless")
    assert MoEConfig.from_dict(yaml.safe_load(yaml.safe_dump(moe.to_dict()))) == moe


def test_from_dict_refuses_unknown_keys_listing_valid_names():
    config_error(lambda: ParallelConfig.from_dict({"data_paralel": 2}),
                 "data_paralel is not a ParallelConfig field", "valid fields: parallel_mode, data_parallel")
    config_error(lambda: ParallelConfig.from_dict({"recompute": {"recompute": True, "mp_comm_recompute": True}}),
                 "recompute.mp_comm_recompute is not supported", "valid fields: recompute, select_recompute")
    config_error(lambda: ParallelConfig.from_dict({"gradient_aggregation_group": 4}),
                 "gradient_aggregation_group is not supported")
    config_error(lambda: MoEConfig.from_dict({"experts": 4}), "experts is not a MoEConfig field", "expert_num")
    config_error(lambda: ParallelConfig.from_dict(["data_parallel", 2]), "expected a mapping")
    config_error(lambda: ParallelConfig(recompute=object()), "recompute=<object", "'full', 'selective'")


def test_cli_strings_are_coerced():
    cfg = ParallelConfig.from_dict({
        "parallel_mode": "Semi_Auto_Parallel", "data_parallel": "2", "model_parallel": "2", "pipeline_stage": "2",
        "micro_batch_num": "4", "pipeline_schedule": "GPipe", "expert_parallel": "2", "optimizer_shard": "2",
        "use_seq_parallel": "true", "vocab_emb_dp": "False", "recompute": "selective",
    })
    assert cfg == semi(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=4,
                       pipeline_schedule="gpipe", expert_parallel=2, optimizer_shard=2, use_seq_parallel=True,
                       vocab_emb_dp=False, recompute="selective")
    assert ParallelConfig(parallel_mode="1").parallel_mode == "semi_auto_parallel"  # MindSpore's mode ids
    assert ParallelConfig(parallel_mode=0).parallel_mode == "data_parallel"
    assert ParallelConfig(parallel_mode=2).parallel_mode == "auto_parallel"
    assert semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="Interleaved1F1B",
                virtual_pipeline_stages=2).pipeline_schedule == "interleaved_1f1b"


@pytest.mark.parametrize(("field", "value", "fragments"), [
    ("data_parallel", "two", ["data_parallel='two'", "integer >= 1"]),
    ("model_parallel", 0, ["model_parallel=0", "integer >= 1"]),
    ("pipeline_stage", True, ["pipeline_stage=True", "integer >= 1"]),
    ("micro_batch_num", 1.5, ["micro_batch_num=1.5", "integer >= 1"]),
    ("expert_parallel", "-2", ["expert_parallel=-2", "integer >= 1"]),
    ("virtual_pipeline_stages", None, ["virtual_pipeline_stages=None", "integer >= 1"]),
    ("use_seq_parallel", "maybe", ["use_seq_parallel='maybe'", "true or false"]),
    ("vocab_emb_dp", 2, ["vocab_emb_dp=2", "true or false"]),
    ("optimizer_shard", "4", ["optimizer_shard='4'", "False, True (=1), 0, 1, 2, 3"]),
    ("optimizer_shard", 1.0, ["optimizer_shard=1.0", "0, 1, 2, 3"]),
    ("parallel_mode", "hybrid_parallel", ["parallel_mode='hybrid_parallel'", *map(repr, PARALLEL_MODES)]),
    ("parallel_mode", 3, ["parallel_mode=3", "'semi_auto_parallel'"]),
    ("pipeline_schedule", "zero_bubble", ["pipeline_schedule='zero_bubble'", *map(repr, PIPELINE_SCHEDULES)]),
    ("recompute", "sometimes", ["recompute='sometimes'", "'full', 'selective'"]),
    ("recompute", -1, ["recompute=-1", "integer >= 0"]),
])
def test_bad_field_values_name_field_value_and_choices(field, value, fragments):
    config_error(lambda: ParallelConfig.from_dict({field: value}), *fragments)


def test_optimizer_shard_true_is_stage_one():
    assert ParallelConfig(optimizer_shard=True).optimizer_shard == 1
    assert ParallelConfig(optimizer_shard="true").optimizer_shard == 1
    assert ParallelConfig(optimizer_shard=False).optimizer_shard == 0
    assert ParallelConfig(optimizer_shard="3").optimizer_shard == 3
    dp2 = ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=True)
    assert dp2.zero_stage == 1
    # One data-parallel rank has nothing to shard across, and stand_alone ignores the layout.
    assert ParallelConfig(parallel_mode="data_parallel", optimizer_shard=3).zero_stage == 0
    assert ParallelConfig(data_parallel=2, optimizer_shard=3).zero_stage == 0


# --- recompute -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shorthand", "mode", "layers"), [
    (False, False, None), (None, False, None), ("none", False, None), ("false", False, None), (0, False, None),
    ("0", False, None), (True, "full", None), ("true", "full", None), ("full", "full", None),
    ("FULL", "full", None), ("selective", "selective", None), (3, "full", 3), ("3", "full", 3),
    ("1", "full", 1), ([2, 1], "full", (2, 1)), ("2,1", "full", (2, 1)),
])
def test_recompute_shorthands(shorthand, mode, layers):
    stages = len(layers) if isinstance(layers, tuple) else 1  # per-stage counts need that many stages
    in_parallel = ParallelConfig(pipeline_stage=stages, micro_batch_num=stages, recompute=shorthand).recompute
    for rc in (RecomputeConfig(recompute=shorthand), in_parallel):
        assert rc.recompute is mode if mode is False else rc.recompute == mode
        assert rc.recompute_num_layers == layers
    assert ParallelConfig(recompute=RecomputeConfig("full")).recompute == RecomputeConfig("full")


def test_recompute_mindformers_style_dicts():
    sel = RecomputeConfig.from_dict({"recompute": False, "select_recompute": True})
    assert sel.recompute == "selective" and sel.select_recompute == ("attention_core",)
    full = RecomputeConfig.from_dict({"recompute": True, "select_recompute": True})
    assert full.recompute == "full"
    off = RecomputeConfig.from_dict({"recompute": False, "select_recompute": False})
    assert off.recompute is False and off.select_recompute == ()
    parts = RecomputeConfig(recompute="selective", select_recompute="mlp,self_attn,mlp")
    assert parts.select_recompute == ("mlp", "self_attn")
    assert RecomputeConfig(recompute="full", recompute_num_layers="2").recompute_num_layers == 2
    assert RecomputeConfig(recompute="full", recompute_num_layers="none").recompute_num_layers is None


def test_recompute_errors():
    config_error(lambda: RecomputeConfig(recompute="selective", select_recompute=["attention"]),
                 "select_recompute='attention'", *map(repr, SELECT_RECOMPUTE_CHOICES))
    config_error(lambda: RecomputeConfig(recompute="selective", select_recompute=[]),
                 "select_recompute=[]", "recompute='selective'", "attention_core")
    config_error(lambda: RecomputeConfig(select_recompute=5), "select_recompute=5", "attention_core, self_attn, mlp")
    config_error(lambda: RecomputeConfig(recompute="full", recompute_num_layers=0),
                 "recompute_num_layers=0", "recompute=False")
    config_error(lambda: RecomputeConfig(recompute="full", recompute_num_layers="many"),
                 "recompute_num_layers='many'", "integer >= 0")
    config_error(lambda: RecomputeConfig(recompute="full", recompute_num_layers=[]),
                 "recompute_num_layers=[]", "per-stage")
    config_error(lambda: RecomputeConfig(recompute=2, recompute_num_layers=3),
                 "recompute_num_layers=3", "recompute=2", "one place")
    rc = RecomputeConfig()
    rc.recompute = 0  # assigned by hand: validate() must catch what construction would have converted
    config_error(rc.validate, "recompute=0", "False, 'full', 'selective'")
    rc = RecomputeConfig("full")
    rc.recompute_num_layers = -1
    config_error(rc.validate, "recompute_num_layers=-1")
    rc = RecomputeConfig("selective")
    rc.select_recompute = ["mlp"]
    config_error(rc.validate, "select_recompute=['mlp']", "expected a list of")


def test_recomputes_layer_is_first_n_layers_per_stage():
    assert not RecomputeConfig(recompute_num_layers=2).recomputes_layer(0)  # recompute off: count ignored
    assert all(RecomputeConfig("full").recomputes_layer(i) for i in range(8))
    first_two = RecomputeConfig(recompute=2)
    assert [first_two.recomputes_layer(i, stage=1) for i in range(4)] == [True, True, False, False]
    per_stage = RecomputeConfig(recompute="selective", recompute_num_layers=[2, 0])
    assert [per_stage.recomputes_layer(i, stage=0) for i in range(3)] == [True, True, False]
    assert not per_stage.recomputes_layer(0, stage=1)
    config_error(lambda: per_stage.recomputes_layer(0, stage=2), "recompute_num_layers=[2, 0]", "stage 2")


# --- MoE -----------------------------------------------------------------------------------------------------


def test_moe_config_fields_and_capacity():
    moe = MoEConfig()
    assert not moe.is_moe and moe.routing_policy == "topk"
    moe = MoEConfig.from_dict({"expert_num": "8", "num_experts_chosen": "2", "capacity_factor": "1.5",
                               "aux_loss_factor": "0", "routing_policy": "TopkRouterV2", "norm_topk_prob": "false"})
    assert moe == MoEConfig(expert_num=8, num_experts_chosen=2, capacity_factor=1.5, aux_loss_factor=0.0,
                            routing_policy="topk", norm_topk_prob=False)
    assert moe.is_moe
    assert moe.expert_capacity(10) == 4  # ceil(1.5 * 10 * 2 / 8)
    assert MoEConfig(expert_num=4, routing_policy="dropless").expert_capacity(10) is None


@pytest.mark.parametrize(("kw", "fragments"), [
    ({"expert_num": 0}, ["expert_num=0", "integer >= 1"]),
    ({"num_experts_chosen": "two"}, ["num_experts_chosen='two'", "integer >= 1"]),
    ({"expert_num": 4, "num_experts_chosen": 5}, ["num_experts_chosen=5", "expert_num=4", "1..4"]),
    ({"capacity_factor": 0}, ["capacity_factor=0", "> 0"]),
    ({"capacity_factor": "inf"}, ["capacity_factor=inf", "> 0"]),
    ({"aux_loss_factor": -0.1}, ["aux_loss_factor=-0.1", ">= 0"]),
    ({"z_loss_factor": True}, ["z_loss_factor=True", ">= 0"]),
    ({"routing_policy": "sinkhorn"}, ["routing_policy='sinkhorn'", "'topk', 'dropless'"]),
    ({"norm_topk_prob": "yes please"}, ["norm_topk_prob='yes please'", "true or false"]),
])
def test_moe_config_errors(kw, fragments):
    config_error(lambda: MoEConfig(**kw), *fragments)


def test_moe_validate_after_mutation():
    for name, value, fragment in (("expert_num", "4", "integer >= 1"), ("capacity_factor", "2", "> 0"),
                                  ("aux_loss_factor", -1.0, ">= 0"), ("routing_policy", "TopkRouterV2", "'topk'"),
                                  ("norm_topk_prob", 1, "true or false")):
        moe = MoEConfig(expert_num=4)
        setattr(moe, name, value)
        config_error(moe.validate, f"{name}={value!r}", fragment)


# --- phase (a): validate() -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "fragments"), [
    ({"pipeline_stage": 4, "micro_batch_num": 2},
     ["micro_batch_num=2", "pipeline_stage=4", "micro_batch_num >= 4"]),
    ({"pipeline_stage": 2, "micro_batch_num": 2, "pipeline_schedule": "interleaved_1f1b"},
     ["virtual_pipeline_stages=1", "interleaved_1f1b", "2 or more"]),
    ({"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2},
     ["pipeline_schedule='interleaved_1f1b'", "pipeline_stage=1", "'gpipe', '1f1b'"]),
    ({"pipeline_stage": 2, "micro_batch_num": 2, "virtual_pipeline_stages": 2},
     ["virtual_pipeline_stages=2", "pipeline_schedule='1f1b'", "interleaved_1f1b"]),
    ({"pipeline_stage": 4, "micro_batch_num": 9, "pipeline_schedule": "interleaved_1f1b",
      "virtual_pipeline_stages": 2}, ["micro_batch_num=9", "pipeline_stage=4", "multiple of", "= 2", "8 or 12"]),
    ({"data_parallel": 4, "model_parallel": 2, "expert_parallel": 3},
     ["expert_parallel=3", "borrowed from data parallelism", "data_parallel=4", "1, 2, 4"]),
    ({"data_parallel": 2, "model_parallel": 2, "expert_parallel": 4},  # ranks are borrowed from dp, not dp x mp
     ["expert_parallel=4", "data_parallel=2", "1, 2"]),
    ({"pipeline_stage": 2, "micro_batch_num": 2, "recompute": [1, 1, 1]},
     ["recompute.recompute_num_layers=[1, 1, 1]", "pipeline_stage=2"]),
    ({"data_parallel": 2, "optimizer_shard": 3, "shard_frozen_head": True},
     ["shard_frozen_head=True", "optimizer_shard=3", "ZeRO-2/3 shard the head already", "optimizer_shard=0"]),
    ({"data_parallel": 2, "model_parallel": 2, "shard_frozen_head": "true"},
     ["shard_frozen_head=True", "model_parallel=2", "vocab_emb_dp=False", "model_parallel=1"]),
    ({"data_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2, "shard_frozen_head": True},
     ["shard_frozen_head=True", "pipeline_stage=2", "pipeline_stage=1"]),
])
def test_validate_layout_errors(kw, fragments):
    config_error(lambda: semi(**kw), *fragments)


@pytest.mark.parametrize("field", ["model_parallel", "pipeline_stage", "expert_parallel"])
def test_data_parallel_mode_uses_only_dp(field):
    kw = {field: 2, "micro_batch_num": 2, "data_parallel": 2}
    config_error(lambda: ParallelConfig(parallel_mode="data_parallel", **kw),
                 f"{field}=2", "parallel_mode='data_parallel'", "expected 1", "'semi_auto_parallel'")


def test_validate_after_mutation_catches_bad_values():
    cfg = semi(data_parallel=2)
    cfg.data_parallel = "2"
    config_error(cfg.validate, "data_parallel='2'", "integer >= 1")
    cfg = semi()
    cfg.pipeline_schedule = "dualpipe"
    config_error(cfg.validate, "pipeline_schedule='dualpipe'", "'interleaved_1f1b'")
    cfg = semi()
    cfg.recompute = "full"
    config_error(cfg.validate, "recompute='full'", "RecomputeConfig")
    cfg = semi()
    cfg.recompute.select_recompute = ("mlp", "norm")
    config_error(cfg.validate, "recompute.select_recompute='norm'")
    for name, value, fragment in (("parallel_mode", "auto", "'stand_alone'"), ("optimizer_shard", True, "0, 1, 2"),
                                  ("use_seq_parallel", "yes", "true or false")):
        cfg = semi()
        setattr(cfg, name, value)
        config_error(cfg.validate, f"{name}={value!r}", fragment)


def test_interleaved_layout_accepted_and_mapped_to_torch():
    cfg = semi(pipeline_stage=4, micro_batch_num=8, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2)
    assert (cfg.pp, cfg.vpp, cfg.micro_batches) == (4, 2, 8)
    from torch.distributed.pipelining.schedules import get_schedule_class

    for schedule in PIPELINE_SCHEDULES:
        name = semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule=schedule,
                    virtual_pipeline_stages=2 if schedule == "interleaved_1f1b" else 1).torch_schedule_name
        assert get_schedule_class(name).__name__.lower().endswith(schedule.replace("_", ""))


# --- phase (b): validate_for() -------------------------------------------------------------------------------


def test_world_size_checks_per_mode():
    config_error(lambda: ParallelConfig().validate_for(0), "world_size=0", "integer >= 1")
    config_error(lambda: ParallelConfig(data_parallel=4).validate_for(4),
                 "parallel_mode='stand_alone'", "world_size=4", "'semi_auto_parallel'")
    ParallelConfig(data_parallel=4, model_parallel=2).validate_for(1)  # stand_alone ignores the layout
    config_error(lambda: ParallelConfig(parallel_mode="data_parallel", data_parallel=2).validate_for(4),
                 "data_parallel=2", "world_size=4", "data_parallel=4")
    ParallelConfig(parallel_mode="data_parallel", data_parallel=4).validate_for(4)
    config_error(lambda: semi(data_parallel=2, model_parallel=2).validate_for(8),
                 "data_parallel*model_parallel*pipeline_stage = 2*2*1 = 4", "world_size=8")
    semi(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2).validate_for(8)


def test_model_divisibility_checks():
    layout = semi(model_parallel=4)
    layout.validate_for(4, model(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64))
    config_error(lambda: layout.validate_for(4, model(num_attention_heads=6)),
                 "model_parallel=4", "num_attention_heads=6", "choose one of: 1, 2")
    config_error(lambda: layout.validate_for(4, model(num_key_value_heads=2)),
                 "model_parallel=4", "num_key_value_heads=2", "1, 2")
    config_error(lambda: layout.validate_for(4, model(intermediate_size=66)),
                 "model_parallel=4", "intermediate_size=66", "1, 2")
    # KV heads default to the query heads.
    config_error(lambda: semi(model_parallel=3).validate_for(3, model(num_attention_heads=8, num_key_value_heads=None,
                                                                      intermediate_size=48)),
                 "num_attention_heads=8", "1, 2, 4, 8")
    # The vocabulary is checked only when it is sharded.
    layout.validate_for(4, model(vocab_size=101))
    config_error(lambda: semi(model_parallel=4, vocab_emb_dp=False).validate_for(4, model(vocab_size=101)),
                 "model_parallel=4", "vocab_size=101", "choose one of: 1")
    # Attributes a config lacks are not checked.
    layout.validate_for(4, SimpleNamespace(num_attention_heads=8))


def test_layers_against_pipeline_stages():
    pp4 = semi(pipeline_stage=4, micro_batch_num=4)
    pp4.validate_for(4, model(num_hidden_layers=4))
    config_error(lambda: pp4.validate_for(4, model(num_hidden_layers=3)),
                 "pipeline_stage=4", "num_hidden_layers=3", "at most 3")
    vpp = semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=3)
    vpp.validate_for(2, model(num_hidden_layers=6))
    config_error(lambda: vpp.validate_for(2, model(num_hidden_layers=5)),
                 "pipeline_stage*virtual_pipeline_stages = 2*3 = 6", "num_hidden_layers=5")


def test_experts_against_expert_parallel():
    ep4 = semi(data_parallel=4, expert_parallel=4)
    ep4.validate_for(4, model(num_experts=8))
    for source in ("num_experts", "expert_num", "num_local_experts"):
        config_error(lambda: ep4.validate_for(4, model(**{source: 6})),
                     "expert_parallel=4", f"{source}=6", "choose one of: 1, 2")
    config_error(lambda: ep4.validate_for(4, model(moe_config=MoEConfig(expert_num=2))),
                 "expert_parallel=4", "moe_config.expert_num=2")
    # a dense model has nothing to split: expert_parallel > 1 there would do nothing, so it is refused
    config_error(lambda: ep4.validate_for(4, model(num_experts=1)), "expert_parallel=4", "without experts")
    semi(data_parallel=2, model_parallel=2).validate_for(4, model(num_experts=1))


def test_hf_config_attributes_are_read():
    from transformers import LlamaConfig, MixtralConfig

    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, vocab_size=128)
    semi(model_parallel=2).validate_for(2, llama)
    config_error(lambda: semi(model_parallel=4).validate_for(4, llama), "num_key_value_heads=2")
    mixtral = MixtralConfig(num_attention_heads=4, num_key_value_heads=4, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_local_experts=6, vocab_size=64)
    config_error(lambda: semi(data_parallel=4, expert_parallel=4).validate_for(4, mixtral),
                 "expert_parallel=4", "=6", "choose one of: 1, 2")


def test_batch_checks():
    pp = semi(data_parallel=2, pipeline_stage=2, micro_batch_num=4)
    pp.validate_for(4, per_device_batch=8, global_batch=16)
    config_error(lambda: pp.validate_for(4, per_device_batch=6),
                 "per_device_train_batch_size=6", "micro_batch_num=4", "multiple of 4")
    config_error(lambda: pp.validate_for(4, global_batch=12),
                 "global_batch=12", "data_parallel*micro_batch_num = 2*4 = 8")
    config_error(lambda: pp.validate_for(4, per_device_batch=0), "per_device_train_batch_size=0", "integer >= 1")
    # Without a pipeline, micro_batch_num is ignored.
    semi(data_parallel=2, micro_batch_num=4).validate_for(2, per_device_batch=3, global_batch=6)


def test_auto_parallel_is_planned_by_with_layout():
    auto = ParallelConfig(parallel_mode="auto_parallel", micro_batch_num=2, recompute="full")
    auto.validate_for(8, model(num_attention_heads=3))  # sizes are the planner's job
    assert auto.is_distributed
    planned = auto.with_layout(2, 2, 2, expert_parallel=2)
    assert planned.parallel_mode == "semi_auto_parallel"
    assert (planned.dp, planned.tp, planned.pp, planned.ep, planned.required_world_size()) == (2, 2, 2, 2, 8)
    assert planned.recompute == auto.recompute and planned.recompute is not auto.recompute
    planned.validate_for(8, model(num_experts=4))
    config_error(lambda: planned.validate_for(8, model(num_attention_heads=3, num_experts=4)), "model_parallel=2")
    config_error(lambda: auto.with_layout(1, 1, 4), "micro_batch_num=2", "pipeline_stage=4")
    config_error(lambda: auto.with_layout(2, dp=2), "dp is not a ParallelConfig field")
    dp_only = ParallelConfig(parallel_mode="data_parallel").with_layout(4)
    assert dp_only.parallel_mode == "data_parallel" and dp_only.required_world_size() == 4


def test_effective_sizes_per_mode():
    layout = dict(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2, expert_parallel=2,
                  optimizer_shard=2, use_seq_parallel=True, vocab_emb_dp=False)
    alone = ParallelConfig(**layout)
    assert (alone.dp, alone.tp, alone.pp, alone.ep, alone.micro_batches, alone.zero_stage) == (1, 1, 1, 1, 1, 0)
    assert not alone.sequence_parallel and not alone.vocab_parallel and alone.required_world_size() == 1
    full = semi(**layout)
    assert (full.dp, full.tp, full.pp, full.ep, full.micro_batches, full.zero_stage) == (2, 2, 2, 2, 2, 2)
    assert full.sequence_parallel and full.vocab_parallel and full.required_world_size() == 8
    assert not semi(use_seq_parallel=True, vocab_emb_dp=False).sequence_parallel  # needs tp > 1
    dp = ParallelConfig(parallel_mode="data_parallel", data_parallel=3, optimizer_shard=3)
    assert (dp.dp, dp.tp, dp.pp, dp.zero_stage, dp.required_world_size()) == (3, 1, 1, 3, 3)
    for name in ("dp", "tp", "pp", "zero_stage", "is_distributed"):
        with pytest.raises(AttributeError):
            setattr(full, name, 1)


# --- overrides (CLI flags on top of a YAML section) ----------------------------------------------------------


def test_with_overrides():
    base = ParallelConfig.from_dict({"parallel_mode": "stand_alone", "data_parallel": 2, "model_parallel": 2,
                                     "recompute": {"recompute": "selective", "select_recompute": ["mlp"]}})
    run = base.with_overrides({"parallel_mode": "semi_auto_parallel", "recompute.recompute_num_layers": "1"})
    assert run.parallel_mode == "semi_auto_parallel" and run.required_world_size() == 4
    assert run.recompute == RecomputeConfig("selective", ("mlp",), 1)
    assert base.parallel_mode == "stand_alone" and base.recompute.recompute_num_layers is None
    assert base.with_overrides({"recompute": "full"}).recompute == RecomputeConfig("full")
    both = base.with_overrides({"recompute": "selective", "recompute.select_recompute": "self_attn,attention_core"})
    assert both.recompute.select_recompute == ("self_attn", "attention_core")
    config_error(lambda: base.with_overrides({"recompute.bogus": 1}), "recompute.bogus is not a RecomputeConfig")
    config_error(lambda: base.with_overrides({"data_parallel.size": 1}), "data_parallel.size", "no sub-fields")
    config_error(lambda: base.with_overrides({"pipeline": 2}), "pipeline is not a ParallelConfig field")
    config_error(lambda: base.with_overrides({"recompute.select_recompute": "norm"}),
                 "recompute.select_recompute='norm'")


def test_optimizer_weight_shard_size_selects_hsdp():
    assert ParallelConfig(parallel_mode="data_parallel", data_parallel=4, optimizer_shard=3).shard_size is None
    hsdp = ParallelConfig(parallel_mode="data_parallel", data_parallel=4, optimizer_shard=3, optimizer_weight_shard_size=2)
    assert hsdp.shard_size == 2
    with pytest.raises(ConfigError, match="optimizer_weight_shard_size=3 .* 1, 2, 4"):
        ParallelConfig(parallel_mode="data_parallel", data_parallel=4, optimizer_weight_shard_size=3)


def test_shard_frozen_head_applies_over_several_data_parallel_ranks_only():
    """The frozen head is split over data x context parallel ranks when there are several; with one (stand-alone, or
    a layout of tensor parallelism alone) the field is not applied, and not refused."""
    split = semi(data_parallel=2, expert_parallel=2, shard_frozen_head=True)
    assert split.resolve(2).frozen_head_sharded and "frozen head split over 2 ranks" in split.describe()
    assert not ParallelConfig(data_parallel=2, optimizer_shard=3, shard_frozen_head=True).resolve(1).frozen_head_sharded
    assert not semi(model_parallel=2, shard_frozen_head=True).resolve(2).frozen_head_sharded
    config_error(lambda: ParallelConfig(shard_frozen_head="sometimes"), "shard_frozen_head='sometimes'",
                 "true or false")
