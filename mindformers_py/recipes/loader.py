"""Reading a task recipe (YAML) and applying command-line overrides to it.

A recipe has the sections ``model``, ``tokenizer``, ``data``, ``training`` (TrainingArguments fields),
``parallel`` (ParallelConfig fields; MindFormers r2.0's ``parallelism`` section is read into it), ``generate`` and
optionally ``peft`` (a peft adapter: peft's type and that config's fields; MindFormers' ``pet_config`` is its
alias), plus top-level ``run_mode``. Overrides name a field by
its bare name when that name is unique across ``training``/``parallel``/top level (``--max_steps 8``,
``--parallel_mode semi_auto_parallel``) or by a dotted path (``--model.num_layers 4``,
``--parallel.recompute.recompute full``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, MindFormersError
from ..parallel.config import ParallelConfig
from .sections import DataSection, GenerateSection, TokenizerSection

TOP_LEVEL_KEYS = ("run_mode", "task")
SECTIONS = ("model", "tokenizer", "data", "training", "parallel", "generate", "peft", "pet_config")
# Sections a flag may remove whole (``--peft null``: train the whole model).
REMOVABLE_SECTIONS = ("peft", "pet_config")
_SECTION_CLASSES = {"tokenizer": TokenizerSection, "data": DataSection, "generate": GenerateSection}


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only ``true``/``false`` are booleans, so ``save_strategy: no``
    or ``--report_to off`` stay strings; each field then reads the value by its own type (a boolean field turns
    ``no`` into False)."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str) -> Any:
    """Parse YAML text with :class:`RecipeLoader`."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass


def _training_fields() -> list[str]:
    """TrainingArguments' fields, and Seq2SeqTrainingArguments' (seq2seq recipes; others refuse them later)."""
    from ..trainer.arguments import Seq2SeqTrainingArguments

    return [f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.name != "parallel_config"]


def section_keys(section: str) -> list[str] | None:
    """Valid keys of a section (None for ``model``, whose keys are the model config's fields)."""
    if section == "training":
        return _training_fields()
    if section == "parallel":
        return ParallelConfig.field_names()
    if section in _SECTION_CLASSES:
        return [f.name for f in dataclasses.fields(_SECTION_CLASSES[section])]
    return None


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Parse a recipe file; errors name the file (and the line, for YAML syntax)."""
    path = Path(path)
    if not path.is_file():
        raise MindFormersError(f"recipe {path} does not exist")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise MindFormersError(f"{where}: YAML syntax error: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MindFormersError(f"recipe {path} cannot be read: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise MindFormersError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    data = from_mindformers_r2(data, str(path))
    check_recipe(data, str(path))
    return data


MINDFORMERS_R2_PARALLELISM = {"data_parallel_shard": "data_parallel", "tensor_parallel": "model_parallel",
                              "context_parallel": "context_parallel", "pipeline_parallel": "pipeline_stage",
                              "expert_parallel": "expert_parallel"}
"""MindFormers r2.0's ``parallelism:`` names -> ours (r1.x's, which ``parallel:`` takes as they are)."""


def from_mindformers_r2(recipe: dict[str, Any], where: str) -> dict[str, Any]:
    """``recipe`` with a MindFormers r2.0 ``parallelism:`` section read into ``parallel:``: its sizes under our names
    (:data:`MINDFORMERS_R2_PARALLELISM`), ``data_parallel_shard`` as FSDP (ZeRO-3, ``optimizer_shard: 3``, unless
    the recipe sets ``optimizer_shard``) over that many data-parallel ranks, and the layout applied as given
    (``semi_auto_parallel``) when a size is above 1 and no ``parallel_mode`` is set. Other r2.0 keys are refused."""
    section = recipe.get("parallelism")
    if section is None:
        return recipe
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: section 'parallelism' must be a mapping, got {section!r}")
    recipe = {k: v for k, v in recipe.items() if k != "parallelism"}
    parallel = dict(recipe.get("parallel") or {})
    for key, value in section.items():
        if key not in MINDFORMERS_R2_PARALLELISM:
            raise ConfigError(f"{where}: parallelism.{key} is not one of MindFormers r2.0's names read here "
                              f"({', '.join(MINDFORMERS_R2_PARALLELISM)}); other fields go in the parallel section")
        if key == "data_parallel_shard" and value == -1:
            raise ConfigError(f"{where}: parallelism.data_parallel_shard=-1 (every device left) is not read here; give "
                              "the number of data-parallel ranks")
        ours = MINDFORMERS_R2_PARALLELISM[key]
        if ours in parallel and parallel[ours] != value:
            raise ConfigError(f"{where}: parallelism.{key}={value!r} contradicts parallel.{ours}={parallel[ours]!r}; "
                              "keep one")
        parallel[ours] = value
    sizes = [v for k, v in parallel.items() if k in MINDFORMERS_R2_PARALLELISM.values()]
    if any(isinstance(v, int) and v > 1 for v in sizes):
        parallel.setdefault("parallel_mode", "semi_auto_parallel")
    shard = section.get("data_parallel_shard")
    if isinstance(shard, int) and shard > 1:
        parallel.setdefault("optimizer_shard", 3)
    recipe["parallel"] = parallel
    return recipe


def check_recipe(recipe: dict[str, Any], where: str) -> None:
    """Refuse unknown sections and unknown keys in the fixed-schema sections."""
    for key, value in recipe.items():
        if key in TOP_LEVEL_KEYS:
            continue
        if key not in SECTIONS:
            raise ConfigError(f"{where}: unknown key {key!r}; valid: {', '.join(TOP_LEVEL_KEYS + SECTIONS)}")
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: section {key!r} must be a mapping, got {value!r}")
        valid = section_keys(key)
        for sub in (value or {}):
            if valid is not None and sub not in valid:
                hint = difflib.get_close_matches(str(sub), valid, n=1)
                raise ConfigError(f"{where}: unknown key {key}.{sub}" + (f" (did you mean {hint[0]}?)" if hint else f"; valid: {', '.join(valid)}"))


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``["--max_steps", "8", "--model.num_layers=4"]`` -> ``[("max_steps", 8), ("model.num_layers", 4)]``.

    Values are parsed as YAML scalars (``8`` -> int, ``true`` -> bool, ``[1,2]`` -> list, ``null`` -> None); ``no``,
    ``off`` and ``none`` stay strings, which each field reads by its type.
    """
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --key value or --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        try:
            parsed = parse_yaml(value)
        except yaml.YAMLError:
            parsed = value
        out.append((key, value if parsed is None and value.lower() not in ("null", "none", "~") else parsed))
        i += 1
    return out


def resolve_key(key: str) -> tuple[str, ...]:
    """The path a bare or dotted override key designates; refuses unknown and ambiguous names."""
    if "." in key:
        section, _, rest = key.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"--{key}: unknown section {section!r}; valid: {', '.join(SECTIONS)}")
        head = rest.split(".")[0]
        valid = section_keys(section)
        if valid is not None and head not in valid:
            hint = difflib.get_close_matches(head, valid, n=1)
            raise ConfigError(f"--{key}: {section} has no field {head!r}" + (f" (did you mean {section}.{hint[0]}?)" if hint else f"; valid: {', '.join(valid)}"))
        return (section, *rest.split("."))
    if key in TOP_LEVEL_KEYS + REMOVABLE_SECTIONS:
        return (key,)
    owners = [s for s in ("training", "parallel") if key in (section_keys(s) or [])]
    if len(owners) > 1:
        raise ConfigError(f"--{key} is ambiguous: it is a field of {' and '.join(owners)}; write --{owners[0]}.{key}")
    if not owners:
        names = _training_fields() + ParallelConfig.field_names() + list(TOP_LEVEL_KEYS)
        hint = difflib.get_close_matches(key, names, n=3)
        raise ConfigError(
            f"--{key} is not a training, parallel or top-level field" + (f" (did you mean {', '.join('--' + h for h in hint)}?)" if hint else "")
            + "; other sections take a dotted path such as --model.num_layers or --data.block_size"
        )
    return (owners[0], key)


def apply_overrides(recipe: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``recipe`` with each override set at its resolved path."""
    recipe = copy.deepcopy(recipe)
    for key, value in overrides:
        path = resolve_key(key)
        if path[0] in REMOVABLE_SECTIONS and len(path) == 1:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"--{key} takes null (no adapter) or a mapping; set one field with --{key}.<field>")
            recipe[key] = value
            continue
        node = recipe
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return recipe


def dump_recipe(recipe: dict[str, Any], path: str | Path) -> None:
    """Write the resolved recipe so the run can be repeated as is (``mindformers-py run path``)."""
    Path(path).write_text(yaml.safe_dump(recipe, sort_keys=False))
