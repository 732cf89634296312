"""A saved adapter under transformers' module names, and an adapter merged into its base model.

Our layers are named as Llama's, so a Llama-like model's adapter needs no renaming; other architectures lay their
weights out differently (GPT-2 fuses ``q_proj``/``k_proj``/``v_proj`` into one transposed ``c_attn``, BERT calls
them ``query``/``key``/``value``). Rather than a second table of names beside each family's converter, the
converter itself is asked: every weight of an adapted layer is filled with its own element numbers and converted,
and where those numbers land in transformers' state dict says which module holds the layer, at which rows of its
output, and whether it is stored transposed (``Conv1D``). From that:

* a LoRA on a layer that is a whole transformers module is renamed;
* LoRAs on layers fused into one transformers module become one LoRA on it, of their ranks summed: ``A`` stacks
  the ``A``s, ``B`` holds each ``B`` (times its scaling) at its layer's rows, so its update is exactly theirs;
* weights trained whole (``modules_to_save``) are converted like the model's own;
* prompt-learning adapters touch no module and are copied.

peft itself sets ``fan_in_fan_out`` for transformers' ``Conv1D`` modules when it loads the adapter.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from .apply import with_saved_adapter
from .files import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, adapter_base, is_adapter_folder
from .config import TASK_TYPES

PREFIX = "base_model.model."
"""Where peft keeps the base model's names in a saved adapter."""
_LORA_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")


@dataclass
class _Placement:
    """Where one of our weights is in transformers' state dict."""

    hf_module: str
    """The transformers module holding it (its key without ``.weight``)."""
    offset: int
    """First row of the module's output that it fills."""
    rows: int
    """Rows (output features) it fills."""
    hf_rows: int
    """Output features of the transformers module."""
    transposed: bool
    """Whether transformers stores it as (in, out) (``Conv1D``)."""


@dataclass
class _HFModule:
    """One transformers module and the adapted layers of ours that it holds."""

    parts: list[tuple[str, _Placement]] = field(default_factory=list)


def _read_adapter(folder: Path, weights: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if not is_adapter_folder(folder):
        raise CheckpointError(f"{folder} holds no peft adapter ({ADAPTER_CONFIG_NAME})")
    try:
        config = json.loads(Path(folder, ADAPTER_CONFIG_NAME).read_text(encoding="utf-8"))
        state = load_file(str(Path(folder, ADAPTER_WEIGHTS_NAME))) if weights else {}
    except (OSError, ValueError) as err:
        raise CheckpointError(f"adapter {folder} cannot be read ({type(err).__name__}: {err})") from None
    return config, state


def adapter_task(folder: str | Path) -> str | None:
    """Our task registry name of a saved adapter's peft ``task_type`` (None when it names none)."""
    adapter_config, _ = _read_adapter(Path(folder), weights=False)
    return {v: k for k, v in TASK_TYPES.items()}.get(adapter_config.get("task_type") or "")


def _placements(config: Any, family: Any, task: str, weights: list[str]) -> dict[str, _Placement]:
    """Where each of our ``weights`` (parameter names of the ``task`` model) is in transformers' state dict, found
    by converting element numbers through the family's converter (see the module docstring)."""
    from ..auto import auto_class_for

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in auto_class_for(task).from_config(copy.deepcopy(config)).state_dict().items()}
    probe: dict[str, torch.Tensor] = {}
    starts: list[tuple[int, str]] = []
    next_id = 1
    for key, shape in shapes.items():
        if key in weights:
            count = math.prod(shape)
            probe[key] = torch.arange(next_id, next_id + count, dtype=torch.float64).view(shape)
            starts.append((next_id, key))
            next_id += count
        else:  # no memory: a zero broadcast to the shape (the converter may still copy it)
            probe[key] = torch.zeros((), dtype=torch.bool).expand(shape)
    missing = [w for w in weights if w not in shapes]
    if missing:
        raise CheckpointError(f"the adapter adapts {missing[0]}, which the base model does not have")
    hf_state = family.converter.state_dict_to_hf(probe, config, task)
    found: dict[str, _Placement] = {}
    begin = torch.tensor([s for s, _ in starts], dtype=torch.float64)
    for hf_key, tensor in hf_state.items():
        if tensor.dtype != torch.float64:
            continue
        ids = tensor.reshape(-1)
        where = (ids > 0).nonzero().squeeze(1)
        if where.numel() == 0:
            continue
        values = ids[where]
        owner = torch.searchsorted(begin, values, right=True) - 1
        for index in owner.unique().tolist():
            ours = starts[index][1]
            mine = owner == index
            local = (values[mine] - starts[index][0]).long()
            found[ours] = _placement(ours, shapes[ours], hf_key, tensor.shape, where[mine], local)
    lost = [w for w in weights if w not in found]
    if lost:
        raise CheckpointError(f"{lost[0]} has no place in transformers' {family.converter.hf_type_for(config)} "
                              "checkpoint; its adapter cannot be exported")
    return found


def _placement(ours: str, shape: torch.Size, hf_key: str, hf_shape: torch.Size, positions: torch.Tensor,
               local: torch.Tensor) -> _Placement:
    """How our tensor ``ours`` (``shape``) sits in ``hf_key`` (``hf_shape``), from the flat positions its elements
    (numbered ``local``) took there."""
    cannot = CheckpointError(f"{ours} is laid out in transformers' {hf_key} in a way an adapter cannot follow")
    if local.numel() != math.prod(shape):
        raise cannot
    module = hf_key.rsplit(".", 1)[0]
    if len(shape) == 1:  # a bias (weights trained whole): a slice of the transformers vector
        if len(hf_shape) != 1 or not torch.equal(positions - positions[0], local):
            raise cannot
        return _Placement(module, int(positions[0]), shape[0], hf_shape[0], False)
    out_features, in_features = shape
    row, col = local // in_features, local % in_features
    if len(hf_shape) != 2:
        raise cannot
    i, j = positions // hf_shape[1], positions % hf_shape[1]
    if hf_shape[1] == in_features and torch.equal(j, col) and torch.equal(i - row, (i - row)[:1].expand_as(i)):
        return _Placement(module, int(i[0] - row[0]), out_features, hf_shape[0], False)
    if hf_shape[0] == in_features and torch.equal(i, col) and torch.equal(j - row, (j - row)[:1].expand_as(j)):
        return _Placement(module, int(j[0] - row[0]), out_features, hf_shape[1], True)
    raise cannot


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    from peft.utils.other import get_pattern_key

    if not patterns:
        return default
    key = get_pattern_key(list(patterns), module)
    return patterns.get(key, default)


def _short_names(chosen: set[str], all_modules: set[str]) -> list[str]:
    """The shortest dotted suffix of each chosen module that matches (as peft matches ``target_modules``) only chosen
    modules."""
    out = set()
    for name in chosen:
        parts = name.split(".")
        for size in range(1, len(parts) + 1):
            suffix = ".".join(parts[-size:])
            if all(m in chosen for m in all_modules if m == suffix or m.endswith("." + suffix)):
                out.add(suffix)
                break
    return sorted(out)


def export_adapter(src: str | Path, dst: str | Path, task: str, base: str | Path | None = None,
                   hf_base: str | None = None) -> Path:
    """Write the adapter saved in ``src`` (trained on our ``task`` model of ``base``, default: its
    ``base_model_name_or_path``) into ``dst`` under transformers' module names, for
    ``PeftModel.from_pretrained(<transformers model>, dst)``; ``hf_base`` is recorded as its base model (e.g. the
    folder ``convert_checkpoint(base, ..., to="hf")`` wrote). Written under a temporary name, renamed when
    complete."""
    from safetensors.torch import save_file

    from ..auto import resolve_config
    from ..checkpoint.safetensors_io import atomic_folder

    src, dst = Path(src), Path(dst)
    adapter_config, state = _read_adapter(src)
    base = str(base) if base is not None else adapter_base(src)
    config, family, _ = resolve_config(base)
    if family.converter is None:
        raise ConfigError(f"the {family.name} family has no converter to transformers' names")
    kind = str(adapter_config.get("peft_type", "")).upper()
    if adapter_config.get("target_parameters"):  # LoRA on stacked expert weights (adapters/experts.py)
        raise ConfigError(f"the adapter in {src} adapts the experts' stacked weights ({', '.join(adapter_config['target_parameters'])}), "
                          "which transformers' MoE models hold fused (gate_up_proj) with another rank layout: export "
                          "it merged into a whole HF model (convert --to hf --merge)")
    new_config = dict(adapter_config)
    new_config["base_model_name_or_path"] = hf_base
    if kind in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING"):
        new_state = dict(state)
    else:
        new_state, new_config = _module_adapter(adapter_config, state, config, family, task, kind, new_config)
    with atomic_folder(dst) as tmp:
        save_file({k: v.contiguous() for k, v in new_state.items()}, str(tmp / ADAPTER_WEIGHTS_NAME),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
        for item in src.iterdir():
            if item.is_file() and item.name not in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
                shutil.copy2(item, tmp / item.name)
    return dst


def _split_key(key: str) -> tuple[str, str]:
    """(our module, the adapter part after it) of a saved adapter key, e.g. ``model.layers.0.self_attn.q_proj`` and
    ``lora_A.weight``; modules trained whole give (module, ``weight``/``bias``)."""
    body = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for part in _LORA_PARTS + ("ia3_l", "hada_", "lokr_", "vera_", "oft_", "boft_"):
        marker = f".{part}"
        if marker in body:
            at = body.index(marker)
            return body[:at], body[at + 1:]
    module, _, param = body.rpartition(".")
    return module, param


def _module_adapter(adapter_config: dict[str, Any], state: dict[str, torch.Tensor], config: Any, family: Any, task: str,
                    kind: str, new_config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    whole = set()
    adapted = set()
    for key in state:
        module, part = _split_key(key)
        (whole if part in ("weight", "bias") else adapted).add(module)
    weights = [f"{m}.weight" for m in adapted] + [f"{m}.{p}" for m in whole for p in ("weight", "bias")
                                                  if f"{PREFIX}{m}.{p}" in state]
    placed = _placements(config, family, task, weights)
    modules: dict[str, _HFModule] = {}
    for ours in sorted(adapted):
        place = placed[f"{ours}.weight"]
        modules.setdefault(place.hf_module, _HFModule()).parts.append((ours, place))
    out: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for hf_module, entry in modules.items():
        whole_module = len(entry.parts) == 1 and entry.parts[0][1].offset == 0 \
            and entry.parts[0][1].rows == entry.parts[0][1].hf_rows
        if whole_module:
            ours = entry.parts[0][0]
            for key, value in state.items():
                module, part = _split_key(key)
                if module == ours:
                    out[f"{PREFIX}{hf_module}.{part}"] = value
            continue
        if kind != "LORA":
            raise ConfigError(f"peft type {kind.lower()!r} on {', '.join(p for p, _ in entry.parts)} cannot be exported: "
                              f"transformers fuses them into {hf_module}; only LoRA adapters are re-fused")
        rank, alpha = _fuse_lora(adapter_config, state, hf_module, entry, out)
        rank_pattern[hf_module], alpha_pattern[hf_module] = rank, alpha
    for ours in sorted(whole):
        for param in ("weight", "bias"):
            key = f"{PREFIX}{ours}.{param}"
            if key in state:
                place = placed[f"{ours}.{param}"]
                value = state[key].t() if place.transposed else state[key]
                out[f"{PREFIX}{place.hf_module}.{param}"] = value.contiguous()
    hf_modules = {k.rsplit(".", 1)[0] for k in _hf_keys(config, family, task)}
    targets = _short_names(set(modules), hf_modules)
    new_config["target_modules"] = targets
    new_config["exclude_modules"] = None
    new_config["layers_to_transform"] = None
    new_config["layers_pattern"] = None
    for name_list in ("feedforward_modules",):  # IA3: which adapted modules scale their input
        names = adapter_config.get(name_list)
        if names:
            chosen = {hf for hf, entry in modules.items() if any(_matches(names, ours) for ours, _ in entry.parts)}
            new_config[name_list] = _short_names(chosen, hf_modules)
    if adapter_config.get("modules_to_save"):
        names = {placed[f"{m}.weight"].hf_module for m in whole}
        new_config["modules_to_save"] = _short_names(names, hf_modules)
    if kind == "LORA":
        # Per-module ranks and alphas of the renamed modules (the original patterns name our modules).
        for hf_module, entry in modules.items():
            if hf_module not in rank_pattern:
                ours = entry.parts[0][0]
                rank_pattern[hf_module] = int(state[f"{PREFIX}{ours}.lora_A.weight"].shape[0])
                alpha_pattern[hf_module] = _pattern_value(adapter_config.get("alpha_pattern"), ours,
                                                          adapter_config.get("lora_alpha"))
        default_r, default_alpha = adapter_config.get("r"), adapter_config.get("lora_alpha")
        new_config["rank_pattern"] = {k: v for k, v in rank_pattern.items() if v != default_r}
        new_config["alpha_pattern"] = {k: v for k, v in alpha_pattern.items() if v != default_alpha}
        transposed = [p.transposed for entry in modules.values() for _, p in entry.parts]
        new_config["fan_in_fan_out"] = bool(transposed) and all(transposed)
    return out, new_config


def _matches(names: str | list[str], module: str) -> bool:
    """Whether ``names`` (a regular expression, or names matched as suffixes) names ``module``, by peft's rule."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == n or module.endswith(f".{n}") for n in names)


def _hf_keys(config: Any, family: Any, task: str) -> list[str]:
    """transformers' parameter names of the ``task`` model of ``config`` (computed on zero-size stand-ins)."""
    from ..auto import auto_class_for

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in auto_class_for(task).from_config(copy.deepcopy(config)).state_dict().items()}
    stand_ins = {k: torch.zeros((), dtype=torch.bool).expand(s) for k, s in shapes.items()}
    return list(family.converter.state_dict_to_hf(stand_ins, config, task))


def _scaling(adapter_config: dict[str, Any], module: str, rank: int) -> float:
    alpha = _pattern_value(adapter_config.get("alpha_pattern"), module, adapter_config.get("lora_alpha"))
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def _fuse_lora(adapter_config: dict[str, Any], state: dict[str, torch.Tensor], hf_module: str, entry: _HFModule,
               out: dict[str, torch.Tensor]) -> tuple[int, float]:
    """One LoRA on ``hf_module`` equal to the LoRAs of the layers fused into it; returns its rank and alpha."""
    if adapter_config.get("use_dora"):
        raise ConfigError(f"DoRA adapters on layers transformers fuses into {hf_module} cannot be exported")
    a_parts = []
    total = sum(int(state[f"{PREFIX}{ours}.lora_A.weight"].shape[0]) for ours, _ in entry.parts)
    # Scaling 1 for the fused module (alpha = rank, or sqrt(rank) with rsLoRA): each B carries its own scaling.
    alpha = math.sqrt(total) if adapter_config.get("use_rslora") else float(total)
    hf_rows = entry.parts[0][1].hf_rows
    fused_b = None
    fused_bias = None
    column = 0
    for ours, place in entry.parts:
        lora_a = state[f"{PREFIX}{ours}.lora_A.weight"]
        lora_b = state[f"{PREFIX}{ours}.lora_B.weight"]
        rank = lora_a.shape[0]
        scale = _scaling(adapter_config, ours, rank)
        if fused_b is None:
            fused_b = lora_b.new_zeros(hf_rows, total)
        fused_b[place.offset:place.offset + place.rows, column:column + rank] = lora_b * scale
        bias = state.get(f"{PREFIX}{ours}.lora_B.bias")
        if bias is not None:
            fused_bias = bias.new_zeros(hf_rows) if fused_bias is None else fused_bias
            fused_bias[place.offset:place.offset + place.rows] = bias * scale
        a_parts.append(lora_a)
        column += rank
    out[f"{PREFIX}{hf_module}.lora_A.weight"] = torch.cat(a_parts, dim=0)
    out[f"{PREFIX}{hf_module}.lora_B.weight"] = fused_b
    if fused_bias is not None:
        out[f"{PREFIX}{hf_module}.lora_B.bias"] = fused_bias
    return total, alpha


def merged_model(src: str | Path, task: str, base: str | Path | None = None) -> torch.nn.Module:
    """Our ``task`` model of ``base`` (default: the adapter's ``base_model_name_or_path``) with the adapter saved in
    ``src`` merged into its weights (peft's ``merge_and_unload``): a plain model, saved and exported like any
    other."""
    from ..auto import auto_class_for

    base = str(base) if base is not None else adapter_base(src)
    model = with_saved_adapter(auto_class_for(task).from_pretrained(base), src)
    return model.merge_and_unload()
