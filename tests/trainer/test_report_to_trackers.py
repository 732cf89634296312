"""``report_to`` takes the trackers transformers users name, through transformers' own integrations and the
trackers' libraries, offline: MLflow with a local file store, Weights & Biases in offline mode. A tracker whose
package is missing is one line naming the install."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

import mindformers_py as mf

pytestmark = pytest.mark.skipif(not (importlib.util.find_spec("mlflow") and importlib.util.find_spec("wandb")),
                                reason="the dev extra's mlflow-skinny and wandb")


def test_mlflow_and_wandb_receive_the_run_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           max_position_embeddings=16))
    rows = torch.randint(0, 64, (8, 8))
    args = mf.TrainingArguments(output_dir="out", max_steps=3, logging_steps=1, per_device_train_batch_size=4,
                                report_to="mlflow,wandb", disable_tqdm=True, run_name="tracked")
    trainer = mf.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    import mlflow

    client = mlflow.tracking.MlflowClient(f"file:{tmp_path / 'mlruns'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_name for r in runs] == ["tracked"]
    logged = [m.value for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert logged == pytest.approx(losses)
    assert "MLflow's log_metric() only accepts" not in capsys.readouterr().err  # the run's text lines stay out

    import wandb

    wandb.finish()  # transformers leaves the run open for the script (it ends with the process); its record is then whole
    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1
    # wandb's service process may still be writing the record when finish() returns (a full run of the suite once read only its header)
    deadline = time.monotonic() + 60
    while offline[0].read_bytes().count(b"train/loss") < len(losses) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert offline[0].read_bytes().count(b"train/loss") >= len(losses)  # each step's loss in the run's record


def test_a_tracker_whose_package_is_missing_is_one_line(monkeypatch):
    from mindformers_py.trainer import arguments

    monkeypatch.setattr(arguments, "tracker_installed", lambda name: name != "wandb")  # as where wandb is missing
    with pytest.raises(mf.MindFormersError, match="report_to='wandb' needs the wandb package, which is not installed: "
                                                  "pip install wandb"):
        mf.TrainingArguments(output_dir="out", report_to="wandb")
    assert mf.TrainingArguments(output_dir="out", report_to="all").report_to == ["tensorboard", "mlflow"]
