"""Wrapping a model in a peft adapter (peft's ``get_peft_model``) after checking the adapter against the model, and
reading / writing the adapter's weights by the names the wrapped model holds them under.

The checks refuse, in one line naming the field: target modules the model does not have (with the names of the
layers it has), and a rank larger than the layer it adapts. Everything else is peft's own.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..loading.deferred import has_meta_parameters
from ..parallel.tensor.adapters import adapted_model, is_peft_model
from ..utils.state_names import state_name
from .config import SECTION, as_peft_config
from .experts import with_expert_parameters
from .files import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, adapter_base, is_adapter_folder



def apply_peft(model: nn.Module, peft_config: Any, task: str | None = None, name: str = SECTION) -> nn.Module:
    """``model`` wrapped by peft in the adapter ``peft_config`` describes (a peft config or a ``peft:`` section;
    ``task`` fills its ``task_type``), after checking its target modules and ranks against ``model``."""
    if is_peft_model(model):
        raise ConfigError(f"{name} was given for a model that is already a peft model ({type(model).__name__}); "
                          "pass the base model, or the peft model without a peft config")
    config = with_expert_parameters(model, as_peft_config(peft_config, name, task), name)
    from peft import get_peft_model

    _check_targets(model, config, name)
    _check_init_without_weights(model, config, name)
    try:
        with adapters_on_host(model, copies_to_meta=True):
            wrapped = get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{name}: peft cannot apply {type(config).__name__} to {type(model).__name__}: {first}") \
            from None
    problem = _rank_problem(wrapped, name)
    if problem:
        wrapped.unload()  # leave the caller's model as it was
        raise ConfigError(problem)
    return wrapped


@contextlib.contextmanager
def adapters_on_host(model: nn.Module, copies_to_meta: bool = False) -> Iterator[None]:
    """While peft adds adapters to ``model``: a base weight still on ``meta`` (a model loaded for a layout to fill
    only its shards) stands in as a CPU tensor of its shape and dtype that holds no memory (stride 0), so peft makes
    each adapter on the CPU with its init, as beside a loaded weight (peft would otherwise put the adapter on
    ``meta`` too, losing its values). The meta weights are put back afterwards, frozen or not as peft left the
    stand-ins; they are filled later and the adapters sharded with them. A model with no ``meta`` weight, or one
    built under a ``torch.device("meta")`` block (for counting), is left as it is.

    ``copies_to_meta``: a base module peft copies (a ``modules_to_save`` head trained whole: peft deep-copies the
    classifier) copies a stand-in's one uninitialised number into every entry; its copies go back to ``meta`` too
    (not when peft loads a saved adapter into the copies afterwards). They keep the
    original's name (a deep copy keeps the module's name tag), so the layout fills them as it fills the original:
    the checkpoint's tensor, or the model's init under the original module's seed, the values a stand-alone run's
    copy of the loaded head holds."""
    if torch.get_default_device().type == "meta" or not has_meta_parameters(model):
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    before = {id(p) for p in model.parameters()}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                stand_in = torch.empty((), dtype=param.dtype).expand(param.shape)
                module._parameters[attr] = nn.Parameter(stand_in, requires_grad=param.requires_grad)
                swapped.append((module, attr, param))
    stand_ins = {id(module._parameters[attr]) for module, attr, _ in swapped}
    try:
        yield
    finally:
        for module, attr, param in swapped:  # (a tied weight gets its one object back in each place)
            param.requires_grad_(module._parameters[attr].requires_grad)
            module._parameters[attr] = param
        if copies_to_meta:
            _copies_back_to_meta(model, before | stand_ins)


def _copies_back_to_meta(model: nn.Module, known: set[int]) -> None:
    """Put the parameters of copies of the model's own modules (peft's ``modules_to_save``), made from stand-ins,
    back on ``meta``: a module carrying the loaded model's name tag whose parameter is none of the ``known`` ones."""
    from ..loading.deferred import NAME_ATTR

    for module in model.modules():
        if NAME_ATTR not in module.__dict__:
            continue  # a module peft added (an adapter): it has its own init
        for attr, param in list(module._parameters.items()):
            if param is not None and not param.is_meta and id(param) not in known:
                module._parameters[attr] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                        requires_grad=param.requires_grad)


# LoRA inits that draw only random numbers (the others read the base weights: PiSSA, OLoRA, EVA, LoftQ, CorDA)
_INITS_WITHOUT_WEIGHTS = (True, False, "gaussian")


def _check_init_without_weights(model: nn.Module, config: Any, name: str) -> None:
    """Refuse an adapter init that reads the base weights for a model whose weights are not loaded yet (a layout
    fills them shard by shard after the adapter is added)."""
    init = getattr(config, "init_lora_weights", True)
    if init not in _INITS_WITHOUT_WEIGHTS and has_meta_parameters(model):
        raise ConfigError(f"{name}.init_lora_weights={init!r} reads the base weights, which a multi-process layout "
                          "loads shard by shard after the adapter is added; use true or 'gaussian', or train "
                          "stand-alone")


def _linear_names(model: nn.Module) -> list[str]:
    """The last name part of every layer holding a weight matrix (what ``target_modules`` usually names)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if n and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.ndim == 2}
    return sorted(names)


def _check_targets(model: nn.Module, config: Any, name: str) -> None:
    """Refuse ``target_modules`` (and ``modules_to_save``) entries that match no module of ``model``."""
    modules = [n for n, _ in model.named_modules() if n]
    targets = getattr(config, "target_modules", None)
    valid = ", ".join(_linear_names(model))
    if isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, n) for n in modules):
            raise ConfigError(f"{name}.target_modules={targets!r} matches no module of {type(model).__name__}; its "
                              f"layers: {valid}")
    elif targets and not isinstance(targets, str):
        for target in sorted(targets):
            if not any(n == target or n.endswith(f".{target}") for n in modules):
                raise ConfigError(f"{name}.target_modules: {target!r} is not a module of {type(model).__name__}; its "
                                  f"layers: {valid}")
    for target in getattr(config, "modules_to_save", None) or ():
        if not any(n == target or n.endswith(f".{target}") for n in modules):
            raise ConfigError(f"{name}.modules_to_save: {target!r} is not a module of {type(model).__name__}; its "
                              f"modules: {', '.join(n for n, _ in model.named_children())}")


def _rank_problem(peft_model: nn.Module, name: str) -> str | None:
    """A message for the first adapted layer whose adapter rank exceeds the layer's smaller dimension, else None."""
    from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features

    for module_name, module in peft_model.get_base_model().named_modules():
        ranks = getattr(module, "r", None)
        if not isinstance(module, BaseTunerLayer) or not isinstance(ranks, Mapping):
            continue
        fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if not isinstance(fan_in, int):  # (a LoRA layer knows them; peft's ParamWrapper per expert, not its module's)
            fan_in, fan_out = _get_in_out_features(module.get_base_layer())
        if fan_in is None:
            continue
        for rank in ranks.values():
            if rank > min(fan_in, fan_out):
                return (f"{name}.r={rank} is larger than {module_name} ({fan_in} -> {fan_out} features); a rank above "
                        f"{min(fan_in, fan_out)} adds no capacity: lower r (or its rank_pattern entry)")
    return None


# -- adapter weights under the wrapped model's names ---------------------------------------------------------------

def _is_prompt_learning(model: nn.Module) -> bool:
    return bool(getattr(model.active_peft_config, "is_prompt_learning", False))


def adapter_names(model: nn.Module) -> dict[str, str]:
    """The adapter's tensors: name in ``adapter_model.safetensors`` -> name in ``model.state_dict()``, by peft's own
    saving rules (run on tensors standing for the names: peft drops the adapter's name, ``...lora_A.weight`` for
    ``...lora_A.default.weight``, and the ``modules_to_save`` level of a head trained whole).

    peft finds the adapter's tensors by the names of its layers in ``named_modules``, which carry recompute's
    wrapper, so the stand-ins are keyed by those names and the wrapper is taken out afterwards (peft's own
    ``save_pretrained`` finds nothing in a recomputed model)."""
    from peft import get_peft_model_state_dict

    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers()]
    stand_ins = {name: torch.tensor(i) for i, name in enumerate(names)}
    # save_embedding_layers=False: the base model's embeddings are never trained here (peft's "auto" would re-read
    # the base model's config to see whether the vocabulary was resized)
    saved = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=model.active_adapter,
                                      save_embedding_layers=False)
    return {state_name(key): state_name(names[int(value)]) for key, value in saved.items()}


def adapter_state(model: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their saved names, taken from ``state`` (keyed by the model's state-dict names,
    e.g. its gathered trainable tensors) or from the model. Prompt-learning adapters save what their prompt encoder
    computes, which peft takes from the model."""
    from peft import get_peft_model_state_dict

    if _is_prompt_learning(model):
        return get_peft_model_state_dict(model, adapter_name=model.active_adapter, save_embedding_layers=False)
    state = model.state_dict() if state is None else state
    return {saved: state[key].detach() for saved, key in adapter_names(model).items()}


def write_adapter(model: nn.Module, folder: str | Path, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``model``'s adapter into ``folder`` as peft's ``save_pretrained`` does (``adapter_config.json``,
    ``adapter_model.safetensors``, peft's model card): ``tensors`` (saved names, :func:`adapter_state`) or the
    model's own."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = adapter_state(model) if tensors is None else tensors
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    if not tensors:
        raise CheckpointError(f"the peft model has no adapter tensors to save into {folder}")
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    config = copy.copy(model.active_peft_config)
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path") or None
    config.inference_mode = True
    config.save_pretrained(str(folder))
    model.create_or_update_model_card(str(folder))


def read_adapter_state(model: nn.Module, folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter weights saved in ``folder`` keyed by ``model``'s own state-dict names (every tensor of the
    adapter must be in the file)."""
    from safetensors.torch import load_file

    path = Path(folder, ADAPTER_WEIGHTS_NAME)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder} is incomplete: no adapter weights ({ADAPTER_WEIGHTS_NAME})")
    try:
        saved = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"adapter weights {path} are damaged ({type(err).__name__})") from None
    names = adapter_names(model)
    missing = [k for k in names if k not in saved]
    if missing or not names:
        raise CheckpointError(f"adapter weights in {folder} do not match the model: missing "
                              f"{missing[0] if missing else 'every adapter tensor'}")
    return {names[k]: v for k, v in saved.items() if k in names}


def load_adapter_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy the adapter weights saved in ``folder`` into ``model`` (a peft model on one process) in place."""
    if _is_prompt_learning(model):  # peft knows where its prompt encoder's saved output goes
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(Path(folder, ADAPTER_WEIGHTS_NAME))), model.active_adapter)
        return
    params = model.state_dict(keep_vars=True)  # state-dict names: recompute's wrappers are not in them
    with torch.no_grad():
        for name, value in read_adapter_state(model, folder).items():
            if params[name].shape != value.shape:
                raise CheckpointError(f"adapter weights in {folder} do not match the model: {name} has shape "
                                      f"{tuple(value.shape)} in the checkpoint, {tuple(params[name].shape)} here")
            params[name].copy_(value)


def check_adapter_source(folder: str | Path, state: Mapping[str, Any] | None = None) -> None:
    """Refuse loading anything but a saved adapter into a peft model: its base weights are loaded before peft wraps
    it (``from_pretrained``), and only the adapter is trained and saved."""
    if state is not None or not is_adapter_folder(folder):
        raise CheckpointError(f"{folder} holds no peft adapter ({ADAPTER_CONFIG_NAME}); a peft model loads only its "
                              "adapter: load the base weights with from_pretrained before the adapter is applied")


def refuse_prompt_learning(model: nn.Module, layout: str) -> None:
    """Refuse prompt-learning adapters (prompt_tuning, p_tuning, prefix_tuning) under a multi-process ``layout``:
    their virtual tokens come from the peft model's own forward, outside the base model that is sharded and cut
    into stages, and peft saves them by running that encoder on whole weights."""
    if not is_peft_model(model):
        return
    config = model.active_peft_config
    if config.is_prompt_learning:
        kind = str(getattr(config.peft_type, "value", config.peft_type)).lower()
        raise ConfigError(f"peft type {kind!r} trains in one process only (its virtual tokens are added outside the "
                          f"base model that {layout} shards); use an adapter inside the model (lora, ia3, ...) or "
                          "parallel_mode='stand_alone'")


# -- saved adapters ---------------------------------------------------------------------------------------------------


def with_saved_adapter(model: nn.Module, folder: str | Path, trainable: bool = False) -> nn.Module:
    """``model`` (the base model, already loaded) with the adapter saved in ``folder``, by peft's
    ``PeftModel.from_pretrained``; ``trainable`` keeps the adapter trainable (continuing its training)."""
    from peft import PeftModel

    try:
        with adapters_on_host(model):
            return PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)
    except (ValueError, KeyError, RuntimeError) as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [type(err).__name__]
        # torch's load error lists the mismatches below a header line: name the first one
        first = next((line for line in lines if line.startswith("size mismatch")), lines[0])
        hint = ("; the adapter's folder holds no classifier labels: load its base model with the run's num_labels / "
                "id2label (run_config.yaml's model section) before the adapter") if "size mismatch" in first and "classifier" in first else ""
        raise CheckpointError(f"adapter {folder} does not fit {type(model).__name__}: {first}{hint}") from None


def from_pretrained_with_adapter(auto_class: Any, folder: str | Path, **kwargs: Any) -> nn.Module:
    """``auto_class.from_pretrained(folder)``, or for a saved adapter its base model with the adapter on it."""
    if not is_adapter_folder(folder):
        return auto_class.from_pretrained(folder, **kwargs)
    return with_saved_adapter(auto_class.from_pretrained(adapter_base(folder), **kwargs), folder)
