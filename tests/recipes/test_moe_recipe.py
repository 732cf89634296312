"""The GPT-MoE recipe (tasks/gpt_moe/pretrain_tiny.yaml, shrunk by flags) through the CLI: stand-alone's per-step
losses and router logs under expert parallelism borrowed from data parallelism, with tensor and pipeline
parallelism (processes launched by the CLI, gloo); router losses, expert loads and dropped tokens in log.jsonl,
TensorBoard and the progress bar."""

import json
from pathlib import Path

import pytest

from mindformers_py.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tasks" / "gpt_moe" / "pretrain_tiny.yaml"
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_recipe")
    (folder / "train.txt").write_text(TEXT)
    (folder / "val.txt").write_text(TEXT[:3000])
    return folder


def run(files: Path, out: Path, *flags: str, data_parallel: int = 1) -> int:
    """The recipe at test size: 2 layers of width 64 with 4 experts of 32, 32-token blocks, 3 steps."""
    small = ["--model.num_hidden_layers", "2", "--model.hidden_size", "64", "--model.max_position_embeddings", "64",
             "--model.moe_config.expert_num", "4", "--model.moe_config.moe_intermediate_size", "32",
             "--tokenizer.vocab_size", "300", "--data.source", "files", "--data.train_files", str(files / "train.txt"),
             "--data.validation_files", str(files / "val.txt"), "--data.block_size", "32", "--max_steps", "3",
             "--logging_steps", "1", "--learning_rate", "0.01", "--disable_tqdm", "true", "--save_strategy", "no",
             "--eval_strategy", "no", "--generate.prompts", "[]", "--output_dir", str(out),
             "--per_device_train_batch_size", str(GLOBAL_BATCH // data_parallel),
             "--bf16", "false"]  # fp32: layouts are compared with stand-alone to 1e-4
    return main(["run", str(RECIPE), *small, *flags])


def _logs(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def stand_alone(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_sa")
    assert run(files, out, "--report_to", "[tensorboard]") == 0
    return out


# The composed layouts from the CLI. Plain ep2 runs this recipe in the recipe x layout matrix
# (tests/recipes/test_recipe_layouts.py); ep4 runs the model in tests/parallel/test_context_parallel.py (dp2_cp2_ep4)
# and dp4 with ep2 in tests/parallel/test_moe_parallel.py.
LAYOUTS = {
    "dp2_tp2_ep2": ["--data_parallel", "2", "--model_parallel", "2", "--expert_parallel", "2"],
    "dp2_pp2_ep2": ["--data_parallel", "2", "--pipeline_stage", "2", "--micro_batch_num", "2", "--expert_parallel", "2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_give_stand_alone_losses(files, stand_alone, tmp_path, monkeypatch, name):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    flags = LAYOUTS[name]
    dp = int(flags[flags.index("--data_parallel") + 1])
    assert run(files, tmp_path / name, "--parallel_mode", "semi_auto_parallel", "--report_to", "[]", *flags,
               data_parallel=dp) == 0
    expected, got = _logs(stand_alone), _logs(tmp_path / name)
    assert len(expected) == len(got) == 3
    for a, b in zip(expected, got):
        for key in ("loss", "grad_norm", "aux_loss", "load_imbalance", "expert_load/0"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (name, key, a, b)
    assert expected[0]["loss"] != pytest.approx(expected[-1]["loss"], rel=1e-3)


def test_router_values_are_logged_beside_the_loss(stand_alone):
    records = [json.loads(line) for line in (stand_alone / "log.jsonl").read_text().splitlines()]
    first = next(r for r in records if "loss" in r)
    assert {"aux_loss", "load_imbalance", *(f"expert_load/{i}" for i in range(4))} <= set(first)
    assert sum(first[f"expert_load/{i}"] for i in range(4)) == pytest.approx(1.0)
    assert "dropped_tokens" not in first  # dropless: nothing to drop
    # each MoE layer's most loaded expert against its mean; their mean is the overall figure
    layers = [first[f"load_imbalance/layer_{i}"] for i in range(2)]
    assert all(value >= 1 for value in layers) and sum(layers) / 2 == pytest.approx(first["load_imbalance"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((stand_alone / "runs").rglob("events.*")).parent))
    events.Reload()
    assert {"train/loss", "train/aux_loss", "train/load_imbalance", "train/expert_load/3",
            "train/load_imbalance/layer_1"} <= set(events.Tags()["scalars"])


def test_capacity_limits_count_and_log_dropped_tokens(files, tmp_path):
    assert run(files, tmp_path, "--report_to", "[]", "--model.moe_config.routing_policy", "topk",
               "--model.moe_config.capacity_factor", "1.0") == 0
    logs = _logs(tmp_path)
    assert all(0 < h["dropped_tokens"] < 1 for h in logs), logs
    for h in logs:  # the layers' shares average to the overall one (every layer routes as many tokens)
        layers = [h[f"dropped_tokens/layer_{i}"] for i in range(2)]
        assert all(0 <= value < 1 for value in layers) and sum(layers) / 2 == pytest.approx(h["dropped_tokens"])


def test_progress_bar_shows_the_router_values():
    from mindformers_py.layers.moe.layer import RouterMetrics
    from mindformers_py.trainer.callbacks import ProgressCallback
    from transformers import TrainerControl, TrainerState

    class Model:
        training_metrics = RouterMetrics(2, 4, 2, [0, 1], False, False)

    callback = ProgressCallback()
    state = TrainerState(max_steps=3, is_world_process_zero=True)

    class Args:
        disable_tqdm = False

    callback.on_train_begin(Args, state, TrainerControl())
    callback.on_log(Args, state, TrainerControl(), logs={"loss": 2.5, "learning_rate": 1e-3, "aux_loss": 2.0312,
                                                          "load_imbalance": 1.25, "expert_load/0": 0.3}, model=Model())
    postfix = callback.bar.postfix
    callback.on_train_end(Args, state, TrainerControl())
    assert "aux_loss=2.031" in postfix and "load_imbalance=1.25" in postfix and "expert_load" not in postfix


@pytest.mark.parametrize("flags, fragments", [
    (["--model.moe_config.num_experts_chosen", "9"], ["num_experts_chosen=9", "expert_num=4"]),
    (["--model.moe_config.routing_policy", "topk", "--model.moe_config.capacity_factor", "0.5"],
     ["capacity_factor=0.5", "routing_policy='topk'"]),
    (["--parallel_mode", "semi_auto_parallel", "--data_parallel", "4", "--expert_parallel", "4",
      "--model.moe_config.expert_num", "6"], ["expert_parallel=4", "moe_config.expert_num=6", "choose one of: 1, 2"]),
    (["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--model_parallel", "2", "--expert_parallel", "4"],
     ["expert_parallel=4", "data_parallel=2"]),
    (["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--expert_parallel", "2",
      "--model.moe_config", "null"], ["expert_parallel=2", "without experts"]),  # a dense model
    (["--parallel_mode", "semi_auto_parallel", "--model_parallel", "2", "--use_seq_parallel", "true"],
     ["use_seq_parallel=True", "experts"]),
])
def test_bad_moe_settings_are_refused_in_one_line(files, tmp_path, capsys, flags, fragments):
    """Refused before any process starts, with the field at fault and what would be valid."""
    assert run(files, tmp_path / "out", *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and all(f in err for f in fragments) and "Traceback" not in err, err
