"""The Trainer's own callbacks, all plain ``transformers.TrainerCallback`` subclasses: a progress bar, the
``log.jsonl`` writer, TensorBoard, and the loss-curve plot. Only the main process writes anything.

``default_callbacks(args)`` lists what a Trainer installs before the user's callbacks: transformers'
``DefaultFlowCallback`` (decides when to log, evaluate, save and stop, from the arguments), then these.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import DefaultFlowCallback

from .arguments import TrainingArguments
from .checkpoint import CURVE_NAME, LOG_NAME


class ProgressCallback(TrainerCallback):
    """A tqdm bar over the optimizer steps showing loss, learning rate and tokens/s (images/s for image tasks) at
    each log, and the values the model's ``training_metrics`` name in ``postfix_keys`` (an MoE model's router loss
    and load imbalance); evaluation results are printed under it. With ``disable_tqdm`` each log is printed as one
    line instead."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.bar is not None:  # the bar of an attempt that died (workers restarted): the new one replaces it
            self.bar.close()
        if state.is_world_process_zero and not args.disable_tqdm:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if self.bar is not None and "loss" in logs:
            postfix = {"loss": f"{logs['loss']:.4f}", "lr": f"{logs.get('learning_rate', 0.0):.2e}"}
            for key, unit in (("tokens_per_second", "tok/s"), ("images_per_second", "img/s")):
                if key in logs:  # the task's throughput item
                    postfix[unit] = f"{logs[key]:.0f}"
            tracker = getattr(kwargs.get("model"), "training_metrics", None)
            for key in getattr(tracker, "postfix_keys", ()):
                if key in logs:
                    postfix[key] = f"{logs[key]:.4g}"
            self.bar.set_postfix(postfix, refresh=False)
            return
        if "layout" in logs and set(logs) <= {"layout", "precision", "compile", "epoch"}:  # what the run started
            line = "\n".join(str(logs[key]) for key in ("layout", "precision", "compile") if key in logs)
        else:
            line = f"step {state.global_step}: " + ", ".join(f"{k}={_short(v)}" for k, v in logs.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class JsonlLoggerCallback(TrainerCallback):
    """Appends every log event to ``<output_dir>/log.jsonl``, one JSON object per line with ``step``, ``epoch``,
    ``time`` (Unix seconds) and the logged values. A resumed run first drops the lines after its checkpoint's
    step, so the file reads as one uninterrupted run."""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        path = Path(args.output_dir) / LOG_NAME
        if not state.is_world_process_zero or state.global_step == 0 or not path.is_file():
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _step_of(line) <= state.global_step]
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / LOG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, "time": round(time.time(), 3), **logs}
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")


class TensorBoardCallback(TrainerCallback):
    """Writes numeric logs to TensorBoard (``torch.utils.tensorboard``) under ``args.tensorboard_dir``:
    ``eval_*`` / ``test_*`` values as ``eval/*`` / ``test/*``, the rest as ``train/*`` (HF's tags); the arguments go to the text tab. A resumed run
    purges the events written after its checkpoint's step."""

    def __init__(self) -> None:
        self.writer: Any = None

    def _open(self, args: TrainingArguments, state: TrainerState) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = state.global_step + 1 if state.global_step > 0 else None
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, purge_step=purge)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.writer is None:
            self._open(args, state)
        name = args.run_name or Path(args.output_dir).name
        self.writer.add_text("args", f"run {name}\n\n```\n{args.to_json_string()}\n```", state.global_step)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is None:
            self._open(args, state)
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                split, _, name = key.partition("_")
                tag = f"{split}/{name}" if split in ("eval", "test") and name else f"train/{key}"
                self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LossCurveCallback(TrainerCallback):
    """Draws ``<output_dir>/loss_curve.png`` (train loss and eval loss against the step) when training ends."""

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.is_world_process_zero and args.plot_loss_curve:
            plot_loss_curve(state.log_history, Path(args.output_dir) / CURVE_NAME)


def plot_loss_curve(log_history: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path | None:
    """Plot the ``loss`` and ``eval_loss`` entries of a ``log_history`` into a PNG at ``path`` (written
    atomically); returns the path, or None when there is nothing to plot. Uses matplotlib's Agg canvas
    directly, so the global backend of the caller (e.g. a notebook) is untouched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evals:
        return None
    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), label="eval loss", color="tab:orange", marker="o", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    os.replace(tmp, path)
    return path


class SaveBeforeFinalEvaluationCallback(TrainerCallback):
    """Saves ``trainer``'s model (``save_model``) when training reaches its last step, before the evaluation that
    step may run: evaluating (generated texts above all) can take long, and a run stopped during it keeps its
    model. ``saved`` says whether it did. The recipes install it."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.saved = trainer, False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_training_stop and control.should_evaluate and not self.saved:
            self.trainer.save_model()
            self.saved = True

    on_epoch_end = on_step_end  # eval_strategy="epoch" asks for the last evaluation at the epoch's end


def default_callbacks(args: TrainingArguments) -> list[TrainerCallback]:
    """The callbacks every Trainer starts with (before the user's): flow control, progress, log.jsonl,
    TensorBoard, MLflow and Weights & Biases when ``report_to`` asks for them, and the loss curve."""
    callbacks: list[TrainerCallback] = [DefaultFlowCallback(), ProgressCallback(), JsonlLoggerCallback()]
    if "tensorboard" in args.report_to:
        callbacks.append(TensorBoardCallback())
    for tracker in ("mlflow", "wandb"):  # transformers' own integrations, driven by the trackers' libraries
        if tracker in args.report_to:
            callbacks.append(_tracker_callback(tracker))
    callbacks.append(LossCurveCallback())
    return callbacks


def _tracker_callback(name: str) -> TrainerCallback:
    """transformers' callback of tracker ``name``; MLflow's is given only the numbers of each log (its metrics are
    numbers: the run's layout, precision and compile lines, which log.jsonl keeps, would each cost a warning)."""
    from transformers.integrations import MLflowCallback, WandbCallback

    if name == "wandb":
        return WandbCallback()

    class NumbersToMLflow(MLflowCallback):
        def on_log(self, args: Any, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
                   model: Any = None, **kwargs: Any) -> None:
            numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            super().on_log(args, state, control, logs=numbers, model=model, **kwargs)

    return NumbersToMLflow()


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return math.inf


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _jsonable(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)
