"""A recipe's ``peft:`` section (or MindFormers' ``pet_config:``) as one of peft's own config objects.

The section names peft's adapter type and that config's own fields, as a ``adapter_config.json`` holds them::

    peft:
      type: lora            # peft's PeftType, any case: lora, ia3, prompt_tuning, loha, ...; peft_type works too
      r: 8
      lora_alpha: 16
      target_modules: [q_proj, v_proj]

Nothing here implements an adapter: the section becomes a ``peft.LoraConfig`` (``IA3Config``, ...) and peft builds
the adapter. MindFormers' ``pet_config`` is read as an alias: ``pet_type`` is the type, ``lora_rank`` is ``r``,
``exclude_layers`` is ``exclude_modules``, and its Llama module names (``wq``, ``wk``, ``wv``, ``wo``, ``w1``,
``w2``, ``w3``) in ``target_modules`` become ours (Llama's: ``q_proj`` ... ``gate_proj``, ``down_proj``,
``up_proj``). Every refusal is a one-line :class:`~mindformers_py.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

SECTION = "peft"
"""The recipe section holding the adapter."""
PET_CONFIG = "pet_config"
"""MindFormers' name of the same section, accepted as an alias."""

# MindFormers' pet_config keys -> peft's.
_PET_KEYS = {"pet_type": "type", "lora_rank": "r", "exclude_layers": "exclude_modules"}
# MindFormers' pet_config keys with no peft counterpart, and why they are refused rather than ignored.
_PET_UNSUPPORTED = {
    "param_init_type": "adapter weights are created in the model's dtype; train with bf16: true for mixed precision",
    "compute_dtype": "adapters compute in the model's dtype; train with bf16: true for mixed precision",
    "freeze_include": "peft freezes every base weight; list weights to train whole in modules_to_save",
    "freeze_exclude": "peft freezes every base weight; list weights to train whole in modules_to_save",
    "lora_b_init": "peft always starts LoRA's B matrix at zero",
}
# MindFormers' pet_type names that are not peft's.
_PET_TYPES = {"ptuning2": "prefix_tuning", "p_tuning_v2": "prefix_tuning"}
# MindFormers' Llama module names -> ours (Llama's), for target_modules / exclude_modules.
_PET_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj",
                "w3": "up_proj"}
# Our task registry names -> peft's TaskType (which picks the PeftModel class; SEQ_CLS also trains the classifier).
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "seq2seq_lm": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS",
              "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS"}


def peft_types() -> dict[str, type]:
    """peft's adapter types by their lower-case name (``lora``, ``ia3``, ``prompt_tuning``, ...) -> config class."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return {str(getattr(k, "value", k)).lower(): cls for k, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()}


def _import_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("the peft section needs the peft package: pip install 'peft>=0.17'") from None


def peft_config_from_dict(section: Mapping[str, Any], name: str = SECTION, task: str | None = None) -> Any:
    """The peft config object a ``peft:`` (or ``pet_config:``) section describes.

    ``name`` is the section's name in messages (``pet_config`` reads MindFormers' keys); ``task`` (a task registry
    name) fills peft's ``task_type`` when the section does not give one.
    """
    _import_peft()
    if not isinstance(section, Mapping):
        raise ConfigError(f"{name}={section!r} is not valid; expected a mapping with a type (lora, ia3, "
                          "prompt_tuning, ...) and that adapter's fields")
    data = dict(section)
    if name == PET_CONFIG:
        data = _from_pet_config(data)
    kind = data.pop("type", None)
    peft_type = data.pop("peft_type", None)
    if kind is not None and peft_type is not None and str(kind).lower() != str(peft_type).lower():
        raise ConfigError(f"{name}.type={kind!r} contradicts {name}.peft_type={peft_type!r}; give one of them")
    kind = kind if kind is not None else peft_type
    types = peft_types()
    if kind is None:
        raise ConfigError(f"{name}.type is required; choose one of: {', '.join(sorted(types))}")
    key = str(kind).strip().lower()
    if key not in types:
        hint = difflib.get_close_matches(key, list(types), n=1)
        raise ConfigError(f"{name}.type={kind!r} is not a peft adapter type" + (f" (did you mean {hint[0]!r}?)" if hint
                          else "") + f"; choose one of: {', '.join(sorted(types))}")
    config_class = types[key]
    fields = [f.name for f in dataclasses.fields(config_class) if f.init]
    for field in data:
        if field not in fields:
            hint = difflib.get_close_matches(str(field), fields, n=1)
            raise ConfigError(f"{name}.{field} is not a {config_class.__name__} field" + (
                f" (did you mean {hint[0]}?)" if hint else f"; its fields: {', '.join(sorted(fields))}"))
    if data.get("task_type") is None and task in TASK_TYPES:
        data["task_type"] = TASK_TYPES[task]
    try:
        return config_class(**data)
    except (TypeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{name} is not a valid {config_class.__name__}: {first}") from None


def as_peft_config(value: Any, name: str = SECTION, task: str | None = None) -> Any:
    """``value`` as a peft config: a peft config object (its ``task_type`` filled from ``task`` when unset), or a
    section mapping (:func:`peft_config_from_dict`)."""
    if isinstance(value, Mapping):
        return peft_config_from_dict(value, name, task)
    _import_peft()
    from peft import PeftConfig

    if not isinstance(value, PeftConfig):
        raise ConfigError(f"{name}={value!r} is not valid; expected a peft config (peft.LoraConfig(...), ...) or a "
                          "mapping such as {'type': 'lora', 'r': 8}")
    if getattr(value, "task_type", None) is None and task in TASK_TYPES:
        value = dataclasses.replace(value, task_type=TASK_TYPES[task])
    return value


def _from_pet_config(data: dict[str, Any]) -> dict[str, Any]:
    """MindFormers' ``pet_config`` keys and names as peft's."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in _PET_UNSUPPORTED:
            raise ConfigError(f"pet_config.{key} is not supported ({_PET_UNSUPPORTED[key]})")
        if key == "lora_a_init":
            if str(value).lower() not in ("normal", "gaussian"):
                raise ConfigError(f"pet_config.lora_a_init={value!r} is not valid; choose one of: 'normal' (peft's "
                                  "init_lora_weights='gaussian'), or leave it out for peft's default")
            out["init_lora_weights"] = "gaussian"
            continue
        key = _PET_KEYS.get(key, key)
        if key == "type":
            value = _PET_TYPES.get(str(value).lower(), value)
        if key in ("target_modules", "exclude_modules"):
            value = _our_module_names(value)
        out[key] = value
    return out


def _our_module_names(value: Any) -> Any:
    """MindFormers' Llama module names in a target list or regular expression as ours."""
    def rename(text: str) -> str:
        return re.sub(r"(?<![A-Za-z0-9_])(w[qkvo123])(?![A-Za-z0-9_])", lambda m: _PET_MODULES[m.group(1)], text)

    if isinstance(value, str):
        return rename(value)
    if isinstance(value, (list, tuple)):
        return [rename(str(v)) for v in value]
    return value


def recipe_peft_config(recipe: Mapping[str, Any], task: str | None = None) -> Any:
    """The peft config of a recipe's ``peft:`` (or ``pet_config:``) section, None without one; both is refused."""
    given = [name for name in (SECTION, PET_CONFIG) if recipe.get(name) is not None]
    if len(given) > 1:
        raise ConfigError(f"the recipe has both {SECTION} and {PET_CONFIG} (its MindFormers alias); keep one")
    return peft_config_from_dict(recipe[given[0]], given[0], task) if given else None
