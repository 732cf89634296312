"""``mindformers-py plan``: the layouts a model can train with on N accelerators, estimated without starting any
process.

The model comes from a preset (``llama_1b``), a recipe (``tasks/gpt/pretrain_tiny.yaml``: its model, batch,
sequence length and parallel settings), an HF ``config.json`` or a checkpoint folder holding one. The device
comes from the catalog shipped in ``devices.yaml`` (:func:`~.device_spec.load_device`), any field overridable.
The search is :func:`~.planner.plan` with ``full_search``: every data x tensor x pipeline (x expert) layout with
its micro-batches, schedule, ZeRO stage, recompute and sequence parallelism, for bf16 training on our runtime.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, MindFormersError
from ..parallel.config import ParallelConfig
from .cost_model import ModelShape
from .device_spec import DeviceSpec, device_catalog, load_device
from .shape_readers import image_sequence_length, shape_from_config, shape_from_hf_dict
from .search import AutoParallelPlan, LayoutEstimate, plan
from .step_time import Runtime

DEFAULT_DEVICE = "h100_80gb"
BF16_BYTES = 2
# Sequence length used when neither the command line nor a recipe gives one: the model's context, capped, since
# long-context models (Llama 3's 131072 positions) are pretrained on much shorter sequences.
DEFAULT_SEQ_CAP = 4096
T5_PRETRAINING_SEQ = 512  # T5 has relative positions and no context length; it was pretrained on 512 tokens


@dataclass
class ModelSource:
    """A model to plan and what its source says about the run."""

    shape: ModelShape
    """The model's sizes."""
    label: str
    """How the source was named (preset, file, folder)."""
    global_batch: int | None = None
    """Sequences per optimizer step over all ranks, from a recipe: its per-device batch x gradient accumulation x
    its own data-parallel size."""
    batch_origin: str = ""
    """How a recipe's global batch is made, for the report's header."""
    seq_length: int | None = None
    """Tokens per sequence, from a recipe."""
    base: ParallelConfig | None = None
    """The recipe's parallel settings (its ZeRO stage and recompute are the least the planner uses)."""
    trainable_params: int | None = None
    """The parameters a recipe's peft adapter trains (gradients and optimizer state are counted for those alone);
    None trains the whole model."""
    fused_loss: bool = False
    """The recipe's ``training.fused_loss``: no whole logits where the head can be fused into the loss."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise MindFormersError(f"{path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object of config fields, got {type(data).__name__}")
    return data


def _from_recipe(path: Path) -> ModelSource:
    """The model, per-rank batch, sequence length and parallel settings of a recipe file."""
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise MindFormersError(f"recipe {path} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(recipe).__name__}")
    model = dict(recipe.get("model") or {})
    name = model.pop("name_or_path", None)
    if not name:
        raise ConfigError(f"recipe {path} has no model.name_or_path (a preset or a checkpoint folder)")
    from ..auto import resolve_config  # noqa: PLC0415  (imports every model family; only the command needs it)

    config, _, _ = resolve_config(name, **model)
    training = recipe.get("training") or {}
    per_device = int(training.get("per_device_train_batch_size", 8))
    accumulation = int(training.get("gradient_accumulation_steps", 1))
    seq = (recipe.get("data") or {}).get("block_size")
    parallel = dict(recipe.get("parallel") or {})
    dp = ParallelConfig.coerce(parallel, "parallel").dp  # the recipe's own layout sets its global batch
    parallel["parallel_mode"] = "auto_parallel"
    base = ParallelConfig.coerce(parallel, "parallel")
    origin = f"the recipe's: {per_device} per rank" + (f" x {accumulation} accumulated" if accumulation > 1 else "") \
        + f" x {dp} data-parallel rank{'s' if dp > 1 else ''}"
    return ModelSource(shape_from_config(config), f"{path} ({name})", global_batch=per_device * accumulation * dp,
                       batch_origin=origin, seq_length=int(seq) if seq else None, base=base,
                       trainable_params=_adapter_parameters(recipe, config),
                       fused_loss=bool(training.get("fused_loss", False)))


def _adapter_parameters(recipe: dict[str, Any], config: Any) -> int | None:
    """Parameters the recipe's ``peft:`` (or ``pet_config:``) adapter trains, counted by peft on the recipe's model
    built without memory; None without an adapter."""
    from ..adapters.config import recipe_peft_config  # noqa: PLC0415  (imports peft; only adapter recipes need it)
    from ..adapters.counting import adapter_parameter_count  # noqa: PLC0415
    from ..task_registry import get_task  # noqa: PLC0415

    task = get_task(recipe.get("task") or "causal_lm").name
    peft_config = recipe_peft_config(recipe, task)
    return adapter_parameter_count(peft_config, config, task) if peft_config is not None else None


def resolve_model(source: str) -> ModelSource:
    """Read the model (and run settings) named by ``source``: a recipe file, a ``config.json``, a checkpoint
    folder or a preset name."""
    path = Path(source)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{path} has no config.json; pass a checkpoint folder, a config.json, a recipe or a preset")
        return ModelSource(shape_from_hf_dict(_read_json(config), str(config)), str(path))
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise MindFormersError(f"recipe {path} does not exist")
        return _from_recipe(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise MindFormersError(f"config file {path} does not exist")
        return ModelSource(shape_from_hf_dict(_read_json(path), str(path)), str(path))
    from ..auto import resolve_config  # noqa: PLC0415

    config, _, _ = resolve_config(source)
    return ModelSource(shape_from_config(config), source)


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """``["memory=96GiB", "inter_node_bandwidth=50e9"]`` as a dict; refuses entries without ``=``."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"--set {pair!r} is not valid; expected FIELD=VALUE, e.g. --set memory=96GiB")
        out[key.strip()] = value.strip()
    return out


def _default_seq(shape: ModelShape) -> int:
    if shape.encoder_layers and not shape.max_positions:
        return T5_PRETRAINING_SEQ
    return min(shape.max_positions, DEFAULT_SEQ_CAP) if shape.max_positions else DEFAULT_SEQ_CAP


@dataclass
class PlanReport:
    """A plan with what it was asked: renders as a table or as JSON."""

    result: AutoParallelPlan
    """The planner's answer: the chosen layout and every candidate."""
    model: ModelSource
    """The planned model and where it came from."""
    device: DeviceSpec
    """The accelerator assumed for every rank."""
    devices: int
    """Accelerators in the job."""
    seq_length: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step over all ranks: every layout is planned for this batch, so their throughputs
    compare."""
    batch_origin: str
    """Where ``global_batch`` comes from (``--global_batch``, the recipe's, or one per device)."""

    def describe_batch(self) -> str:
        """The global batch in words, and where it comes from."""
        return f"global batch {self.global_batch} sequences ({self.batch_origin})"

    def text(self, top: int = 10) -> str:
        """The layouts that fit, fastest first, the choice marked; ``top`` rows (0: all)."""
        shape, device = self.model.shape, self.device
        fitting = sorted((c for c in self.result.candidates if c.fits), key=lambda c: -c.samples_per_second)
        shown = fitting if top <= 0 else fitting[:top]  # the choice is the fastest that fits: always shown
        lines = [
            f"plan for {self.model.label}: {shape.model_type or 'model'}, {shape.total_params() / 1e9:.2f} B parameters"
            + (f" ({shape.experts} experts, top-{shape.top_k})" if shape.is_moe else "")
            + f", {shape.total_layers} layers, hidden {shape.hidden}",
            f"on {self.devices} x {device.name or device.device_type} ({device.devices_per_node} per node, "
            f"{_gib(device.usable_bytes)} usable per rank); {self.describe_batch()} of {self.seq_length} tokens; "
            "bf16 activations, fp32 weights and AdamW",
        ]
        if self.model.trainable_params is not None:
            lines.append(f"peft adapter: {self.model.trainable_params:,} trainable parameters "
                         f"({self.model.trainable_params / shape.total_params():.3%} of the model); gradients and "
                         "AdamW state for those alone, the frozen base held as usual")
        if self.model.fused_loss:
            lines.append("fused_loss: one chunk of logits at a time (of the rank's own vocabulary under vocabulary-"
                         "parallel tp; a ZeRO-2/3 head only frozen, gathered for the loss alone)")
        cols = ["", "layout", "mem/rank", "compute", "mem-bound", "TP", "EP", "DP", "PP", "bubble", "step",
                "tokens/s", "MFU"]
        rows = []
        for est in shown:
            t = est.time
            mfu = est.mfu(device)
            rows.append(["*" if est is self.result.chosen else "", est.describe(), _gib(est.memory.total),
                         _s(t.compute), _s(t.memory_bound), _s(t.tensor_parallel), _s(t.expert_parallel),
                         _s(t.data_parallel), _s(t.pipeline_comm), _s(t.bubble), _s(t.total),
                         f"{est.tokens_per_second:,.0f}", f"{mfu:.1%}" if mfu is not None else "-"])
        widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
        for row in rows:
            lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
        hidden = len(fitting) - len([r for r in shown if r.fits])
        unfit = len(self.result.candidates) - len(fitting)
        notes = []
        if hidden > 0:
            notes.append(f"{hidden} more layout(s) fit (--top 0 lists them)")
        if unfit:
            notes.append(f"{unfit} layout(s) exceed the memory")
        if self.result.excluded:
            notes.append(f"{len(self.result.excluded)} refused before estimating (--json gives the reasons)")
        if notes:
            lines.append("; ".join(notes))
        lines.append(f"* {self.result.summary()}")
        lines.append("  as a recipe's parallel section: " + _parallel_flags(self.result.config))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Everything the table shows, for every candidate (fitting or not), plus the refused layouts."""
        shape, device = self.model.shape, self.device
        return {
            "model": {"source": self.model.label, "model_type": shape.model_type, "parameters": shape.total_params(),
                      "layers": shape.total_layers, "hidden": shape.hidden, "experts": shape.experts,
                      "top_k": shape.top_k},
            "device": dataclasses.asdict(device),
            "devices": self.devices,
            "seq_length": self.seq_length,
            "global_batch": self.global_batch,
            "batch_origin": self.batch_origin,
            "chosen": _candidate_json(self.result.chosen, device),
            "candidates": [_candidate_json(c, device) for c in sorted(self.result.candidates,
                                                                       key=lambda c: (not c.fits, -c.samples_per_second))],
            "excluded": [{"layout": layout, "reason": reason} for layout, reason in self.result.excluded],
        }


def _candidate_json(est: LayoutEstimate, device: DeviceSpec) -> dict[str, Any]:
    pc = est.config
    mem = est.memory
    return {
        "layout": est.describe(),
        "data_parallel": pc.dp, "context_parallel": pc.cp, "context_parallel_algo": pc.context_parallel_algo,
        "model_parallel": pc.tp, "pipeline_stage": pc.pp, "expert_parallel": pc.ep,
        "micro_batches": pc.micro_batches, "pipeline_schedule": pc.pipeline_schedule,
        "virtual_pipeline_stages": pc.vpp, "zero_stage": pc.zero_stage, "recompute": pc.recompute.recompute,
        "sequence_parallel": pc.sequence_parallel, "vocab_parallel": pc.vocab_parallel,
        "per_device_batch": est.per_device_batch,
        "memory_bytes": {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer": mem.optimizer,
                         "activations": mem.activations, "recompute": mem.recompute, "context": mem.context,
                         "logits_gradient": mem.logits_gradient, "runtime": mem.runtime, "total": mem.total},
        "fits": est.fits,
        "step_seconds": est.time.as_dict(),
        "tokens_per_second": est.tokens_per_second,
        "samples_per_second": est.samples_per_second,
        "mfu": est.mfu(device),
        "parallel_config": pc.to_dict(),
    }


def _parallel_flags(pc: ParallelConfig) -> str:
    """The layout as a recipe's ``parallel`` section in YAML flow style (default fields left out)."""
    fields = {"parallel_mode": pc.parallel_mode, "data_parallel": pc.dp, "model_parallel": pc.tp,
              "pipeline_stage": pc.pp}
    if pc.cp > 1:
        fields.update(context_parallel=pc.cp, context_parallel_algo=pc.context_parallel_algo)
    if pc.ep > 1:
        fields["expert_parallel"] = pc.ep
    if pc.pp > 1:
        fields.update(micro_batch_num=pc.micro_batches, pipeline_schedule=pc.pipeline_schedule)
        if pc.vpp > 1:
            fields["virtual_pipeline_stages"] = pc.vpp
    if pc.zero_stage:
        fields["optimizer_shard"] = pc.zero_stage
    if pc.recompute.enabled:
        fields["recompute"] = pc.recompute.recompute
        if pc.recompute.recompute == "selective" and pc.recompute.select_recompute != ("attention_core",):
            parts = ", ".join(pc.recompute.select_recompute)
            fields["recompute"] = f"{{recompute: selective, select_recompute: [{parts}]}}"
    if pc.sequence_parallel:
        fields["use_seq_parallel"] = True
    if pc.vocab_parallel:
        fields["vocab_emb_dp"] = False
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()) + "}"


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _s(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def run_plan(source: str, devices: int, device: str = DEFAULT_DEVICE, devices_per_node: int | None = None,
             global_batch: int | None = None, seq_length: int | None = None,
             overrides: dict[str, str] | None = None, runtime: Runtime | None = None) -> PlanReport:
    """Plan ``source`` on ``devices`` accelerators of kind ``device`` (see the module docstring).

    Without ``global_batch``, a recipe's global batch is used (its per-device batch x gradient accumulation x its
    own data-parallel size: the same samples per step in every layout, as the recipe trains), else one sequence per
    device; without
    ``seq_length``, a recipe's ``data.block_size``, else the model's context length capped at
    :data:`DEFAULT_SEQ_CAP` (vision encoders: their patch count).

    Raises:
        MindFormersError: a missing or damaged source, an unknown device or field, a bad size, or a model that
            fits no layout.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"devices={devices!r} is not valid; expected a positive integer")
    for name, value in (("global_batch", global_batch), ("seq_length", seq_length),
                        ("devices_per_node", devices_per_node)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} is not valid; expected a positive integer")
    model = resolve_model(source)
    fields: dict[str, Any] = dict(overrides or {})
    if devices_per_node is not None:
        fields["devices_per_node"] = devices_per_node
    spec = load_device(device, **fields)
    shape = model.shape
    image_seq = image_sequence_length(shape)
    if image_seq and seq_length and seq_length != image_seq:
        raise ConfigError(f"seq_length={seq_length} does not apply to {shape.model_type}: an image is {image_seq} "
                          "tokens (patches and the class token); leave --seq_length out")
    seq = image_seq or seq_length or model.seq_length or _default_seq(shape)
    if global_batch is not None:
        origin = "--global_batch"
    elif model.global_batch is not None:
        global_batch, origin = model.global_batch, f"{model.batch_origin}; --global_batch to change"
    else:
        global_batch, origin = devices, "one per device; --global_batch to change"
    result = plan(shape, devices, None, seq, global_batch=global_batch, device=spec,
                  base=model.base, act_bytes=BF16_BYTES, runtime=runtime, full_search=True,
                  trainable_params=model.trainable_params, fused_loss=model.fused_loss)
    return PlanReport(result, model, spec, devices, seq, global_batch, origin)


def device_names() -> list[str]:
    """Names of the accelerators in the catalog."""
    return list(device_catalog())
