"""Auto classes: one entry point for presets, our checkpoints and HF checkpoints of the architectures we cover.

``AutoModelForCausalLM.from_pretrained(x)`` accepts a preset name (random init), a folder saved by us, a folder
holding an HF checkpoint (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``bert``, ``roberta``, ...), which is
converted on load, or a Hugging Face Hub id, read from the Hugging Face cache (or a package that ships it) as
transformers reads it (:mod:`mindformers_py.models.hub`).
Our model types are also registered with transformers' own Auto classes, so
``transformers.AutoModelForCausalLM.from_pretrained(folder_saved_by_us)`` returns our model.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers import GenerationConfig, PretrainedConfig

from .errors import CheckpointError, ConfigError, MindFormersError, check_choice
from .models import registry
from .models.hf_config import own_config
from .models.hub import HUB_KWARGS, hub_options, resolve_source
from .models.packaged import packaged_checkpoint_path
from .models.registry import BASE, Family
from .task_registry import TASKS, get_task, task_for_architectures
from .utils.typed_values import coerce_fields

if TYPE_CHECKING:  # transformers' modeling module costs seconds; it loads with the first model
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def _read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; pass a checkpoint folder or a preset ({', '.join(registry.all_presets())})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None


def _family_of(model_type: str | None, where: str) -> Family:
    family = registry.family_for_model_type(model_type or "")
    if family is None:
        raise ConfigError(f"model_type={model_type!r} in {where} is not supported; supported: {', '.join(registry.all_model_types())}")
    return family


def resolve_config(name_or_path: str | os.PathLike, **overrides: Any) -> tuple[PretrainedConfig, Family, bool]:
    """(our config, its family, whether the source is an HF checkpoint) for a preset name or a folder.

    ``overrides`` are config fields; for a preset they take part in deriving the other sizes (``hidden_size``
    changes ``head_dim``), for a checkpoint they replace stored values (dropout, labels, ...). String values of
    typed fields are read by the field's type (``"no"`` for a boolean field is False), as recipes and command-line
    flags give them.
    """
    hub = hub_options(overrides)
    subfolder = hub.pop("subfolder", "")
    name_or_path = resolve_source(name_or_path, **hub)
    path = Path(name_or_path, subfolder)
    if path.is_dir():
        raw = _read_config_json(path)
        family = _family_of(raw.get("model_type"), str(path / "config.json"))
        from_hf = raw.get("model_type") != family.config_class.model_type
        stored = family.converter.config_from_hf(raw) if from_hf else family.config_class.from_dict(raw)
        return _with_overrides(stored, family, overrides), family, from_hf
    family = registry.family_for_preset(str(name_or_path))
    if family is None or subfolder:
        raise _not_found(str(path))
    preset = family.presets[str(name_or_path)]
    _check_fields(family.config_class(**preset), overrides)
    overrides = coerce_fields(family.config_class, overrides)
    return family.config_class(**{**preset, **overrides}), family, False


def _with_overrides(config: PretrainedConfig, family: Family, overrides: dict[str, Any]) -> PretrainedConfig:
    """A copy of ``config`` (a checkpoint's or a given one) with ``from_pretrained``'s config keywords applied, as
    transformers applies them: any field or alias of the config's flavour (``rms_norm_eps`` on a Llama,
    ``n_inner`` on a GPT-2), None re-deriving a derived size as when the config was made (``n_inner=None`` is
    4 x ``n_embd``), and fewer ``num_hidden_layers`` keeping the first layers' ``layer_types``."""
    _check_fields(config, overrides)
    if not overrides:
        return copy.deepcopy(config)
    data = config.to_dict()
    layers = overrides.get("num_hidden_layers")
    kinds = data.get("layer_types")
    if isinstance(layers, int) and isinstance(kinds, list) and "layer_types" not in overrides:
        # one kind for every layer is re-derived for any depth; mixed kinds keep those of the layers that remain
        data["layer_types"] = None if len(set(kinds)) <= 1 else kinds[:layers]
    return family.config_class.from_dict({**data, **coerce_fields(family.config_class, overrides)})


def _not_found(name: str) -> ConfigError:
    """The error for a source that is no folder and no preset: "no such folder" for what looks like a path, the
    closest preset for a near miss, else the presets."""
    if os.sep in name or "/" in name or name.startswith((".", "~")):
        return ConfigError(f"no such folder: {name!r} (expected a checkpoint folder, a preset name or a Hugging Face "
                           "Hub id)")
    presets = registry.all_presets()
    close = difflib.get_close_matches(name, presets, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"presets: {', '.join(presets)}"
    return ConfigError(f"{name!r} is neither a checkpoint folder nor a preset; {hint}")


def _check_fields(probe: PretrainedConfig, overrides: dict[str, Any], caller: str = "from_pretrained",
                  arguments: Sequence[str] | None = None) -> None:
    """Refuse keys that are neither fields (or aliases) of the config ``probe`` nor ``caller``'s arguments
    (``arguments``; default: the models' :data:`LOADING_KWARGS`), listing both."""
    config_class = type(probe)
    for key in overrides:
        if not hasattr(probe, key):
            own = [f for f in vars(config_class).get("__annotations__", {}) if not f.startswith("_")]
            common = ["num_labels", "id2label", "label2id", "problem_type", "output_hidden_states", "output_attentions"]
            article = "an" if caller[0] in "AEIOU" else "a"
            valid = list(arguments or LOADING_KWARGS)
            close = difflib.get_close_matches(key, own + common + valid, n=1)
            if close:  # a typo: the one name meant, not every name
                raise ConfigError(f"{key!r} is not a {config_class.__name__} field nor {article} {caller} argument; "
                                  f"did you mean {close[0]!r}?")
            raise ConfigError(f"{key!r} is neither a {config_class.__name__} field ({', '.join(own + common)}) nor "
                              f"{article} {caller} argument ({', '.join(valid)})")


class AutoConfig:
    """Configs by preset name, checkpoint folder or model type."""

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **kwargs: Any) -> Any:
        """Our config for a preset name, our checkpoint folder or an HF checkpoint folder (converted); the other
        keywords are config fields overriding the stored values.

        transformers' keywords keep their meanings (:data:`CONFIG_KWARGS`): ``subfolder`` reads the config from
        that folder inside ``name_or_path``; ``return_unused_kwargs=True`` returns ``(config, unused)``, the
        keywords that are no config field, instead of refusing them; the hub's keywords (``revision``,
        ``cache_dir``, ``local_files_only``, ``token``, ...) choose the files of a hub id, as in transformers, and
        change nothing for a local folder or a preset."""
        return_unused = bool(kwargs.pop("return_unused_kwargs", False))
        kwargs.pop("trust_remote_code", None)  # our classes are this package's: no remote code to trust
        hub = hub_options(kwargs)  # which files of a hub repository: resolved by huggingface_hub (models/hub.py)
        subfolder = {"subfolder": hub.pop("subfolder")} if "subfolder" in hub else {}
        source = resolve_source(name_or_path, **hub)  # once: both reads below take the local folder (or preset)
        stored = resolve_config(source, **subfolder)[0]
        unused = {k: v for k, v in kwargs.items() if not hasattr(stored, k)}
        if unused and not return_unused:
            _check_fields(stored, unused, "AutoConfig.from_pretrained", CONFIG_KWARGS)
        config = resolve_config(source, **subfolder, **{k: v for k, v in kwargs.items() if k not in unused})[0]
        return (config, unused) if return_unused else config

    @classmethod
    def for_model(cls, model_type_or_preset: str, **kwargs: Any) -> PretrainedConfig:
        """A config for one of our model types (e.g. ``"mindformers_gpt"``) or a preset, with ``kwargs`` applied."""
        family = registry.family_for_preset(model_type_or_preset)
        if family is not None:
            return family.config_class(**{**family.presets[model_type_or_preset], **kwargs})
        for family in registry.FAMILIES:
            if family.config_class.model_type == model_type_or_preset:
                return family.config_class(**kwargs)
        valid = [f.config_class.model_type for f in registry.FAMILIES] + registry.all_presets()
        raise ConfigError(f"model_type={model_type_or_preset!r} is not known; choose one of: {', '.join(valid)}")

    @classmethod
    def show_support_list(cls) -> dict[str, list[str]]:
        """Print and return the presets of each family (and the HF architectures it loads)."""
        table = {f.name: list(f.presets) for f in registry.FAMILIES}
        for f in registry.FAMILIES:
            print(f"{f.name}: presets {', '.join(f.presets)}; loads HF {', '.join(f.hf_types) or '-'}")
        return table


class _AutoModel:
    """Base of the Auto model classes; ``_task`` (``"base"`` or a task registry name) picks the head."""

    _task = BASE

    @classmethod
    def _model_class(cls, family: Family) -> type[PreTrainedModel]:
        try:
            return family.model_classes[cls._task]
        except KeyError:
            raise ConfigError(f"the {family.name} family has no {cls._task} model; it has: {', '.join(family.model_classes)}") from None

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any) -> PreTrainedModel:
        """A randomly initialised model for ``config`` (ours or a transformers config of an architecture we convert),
        as transformers' ``from_config``: ``dtype`` (or ``torch_dtype``) and ``attn_implementation`` are taken, and
        ``device_map`` too (``trust_remote_code`` changes nothing: our classes are this package's, not remote code).
        The model is built on ``meta`` and each module's weights are drawn once, in that dtype on that device (a
        large preset is never materialised in float32 on the host first); under
        :func:`~mindformers_py.loading.deferred_loading` they are left to a layout to fill shard by shard. Under a
        ``torch.device("meta")`` block the model stays on ``meta`` with nothing drawn."""
        family = _family_of(getattr(config, "model_type", None), type(config).__name__)
        model_class = cls._model_class(family)
        unknown = sorted(set(kwargs) - {"dtype", "torch_dtype", "attn_implementation", "device_map", "trust_remote_code"})
        if unknown:
            raise ConfigError(f"from_config got {unknown[0]!r}; it takes dtype, attn_implementation, device_map and "
                              "trust_remote_code (set model fields on the config)")
        if torch.get_default_device().type == "meta":
            return model_class(config)
        from .loading import deferred
        from .loading.placement import kept_in_fp32, place

        config = own_config(family.config_class, config)
        if kwargs.get("attn_implementation") is not None:
            check_choice("attn_implementation", kwargs["attn_implementation"], ATTN_IMPLEMENTATIONS)
            config._attn_implementation = kwargs["attn_implementation"]
        dtype = kwargs.get("dtype") or kwargs.get("torch_dtype")
        dtype = None if dtype in (None, "auto") else _resolve_dtype(dtype, Path(), None)
        model = deferred.build_empty(model_class, config)
        deferred.give_record(model, deferred.DeferredWeights(folder=None, from_hf=False, sources={},
                                                             seed=deferred.draw_seed(), dtype=dtype,
                                                             keep_fp32=kept_in_fp32(model, dtype)))
        return model if deferred.loading_is_deferred() else place(model, kwargs.get("device_map"))

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any) -> Any:
        """Load a preset (random init), our checkpoint, or an HF checkpoint (converted), in eval mode.

        Takes transformers' loading arguments (:data:`LOADING_KWARGS`, applied by :func:`load_pretrained`) with their
        meanings; every other keyword is a config field overriding the stored value (``num_labels=3``, dropout, ...).
        """
        return load_pretrained(cls._model_class, name_or_path, *model_args, caller=cls.__name__, **kwargs)


def load_pretrained(choose_class: Callable[[Family], type[PreTrainedModel]], name_or_path: str | os.PathLike,
                    *model_args: Any, caller: str = "from_pretrained", **kwargs: Any) -> Any:
    """The loading behind every ``from_pretrained`` of ours (see :meth:`_AutoModel.from_pretrained`): the config of
    the preset or checkpoint, the model class ``choose_class`` picks for its family, the weights (converted from an
    HF checkpoint), transformers' loading options.

    The model is built on the ``meta`` device and each tensor is then read (lazily, from the memory-mapped files),
    converted and placed one at a time in the requested dtype on the requested device; what the checkpoint lacks
    (a new head, every weight of a preset) gets the model's own init (:mod:`mindformers_py.loading.deferred`). Under
    :func:`~mindformers_py.loading.deferred_loading` the model is returned with its parameters still on ``meta``,
    for a layout to fill only its shards."""
    if model_args:
        raise ConfigError(f"{caller}.from_pretrained takes no positional model arguments after the path "
                          f"(got {len(model_args)}); pass config fields as keywords")
    given = name_or_path
    adapter = _transformers_internal_options(kwargs)
    hub = hub_options(kwargs)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in LOADING_KWARGS}
    subfolder = hub.pop("subfolder", "")
    name_or_path = resolve_source(name_or_path, **hub)  # a hub id: its snapshot in the Hugging Face cache
    folder = Path(name_or_path, subfolder)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        return _load_with_adapter(choose_class, folder, caller, options, kwargs)
    source = folder if folder.is_dir() else name_or_path
    if not folder.is_dir() and registry.is_preset(str(name_or_path)):
        _say_preset(str(name_or_path))
    if options.get("use_safetensors") is False:
        raise CheckpointError("use_safetensors=False asks for pickled weights (pytorch_model.bin), which are never "
                              "loaded (unpickling can run code); convert the checkpoint to safetensors")
    if options.get("config") is not None:
        config, family, from_hf = _given_config(options["config"], source, kwargs)
    else:
        config, family, from_hf = resolve_config(source, **kwargs)
    # The name given, as transformers keeps it; a packaged checkpoint's name is kept as its folder instead, which
    # the tools that reload ``name_or_path`` (AutoTokenizer, peft, sentence-transformers) find without the hub.
    config._name_or_path = str(given if name_or_path == given or not _is_packaged(given) else name_or_path)
    attn = options.get("attn_implementation")
    if attn is not None:
        check_choice("attn_implementation", attn, ATTN_IMPLEMENTATIONS)
        config._attn_implementation = attn
    model_class = choose_class(family)  # a head the family lacks is refused before any weight is read
    from .loading import deferred, load_plan
    from .checkpoint.reader import CheckpointReader
    from .loading.conversion_trace import ConversionTrace
    from .loading.placement import kept_in_fp32, place

    trace = None
    if folder.is_dir():
        reader = CheckpointReader(folder)
        convert = (lambda state: family.converter.state_dict_from_hf(state, config)) if from_hf else None
        trace = ConversionTrace(reader, convert)  # before the model is built: the weights may settle the config
    model = deferred.build_empty(model_class, config)
    plan = (load_plan.plan_load(model, trace.shapes, folder, bool(options.get("ignore_mismatched_sizes")))
            if trace is not None else None)
    dtype = _resolve_dtype(options.get("dtype") or options.get("torch_dtype") or "auto", folder, trace)
    if dtype is not None:
        config.dtype = dtype  # as transformers records the dtype it loaded in
    record = deferred.DeferredWeights(
        folder=str(folder) if trace is not None else None, from_hf=from_hf,
        sources=dict(plan.sources) if plan is not None else {}, seed=deferred.draw_seed(), dtype=dtype,
        keep_fp32=kept_in_fp32(model, dtype))
    deferred.give_record(model, record, {k: trace.dtypes[v] for k, v in record.sources.items()} if trace else {})
    device_map = options.get("device_map")
    if deferred.loading_is_deferred():
        if device_map is not None:
            raise ConfigError(f"device_map={device_map!r} cannot be used while loading is deferred (the layout "
                              "places the shards); leave it out")
    else:
        model = place(model, device_map, options.get("max_memory"), options.get("offload_folder"))
    if trace is not None and (folder / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        model.generation_config = _generation_config(folder)
    model.eval()
    info = plan.loading_info() if plan is not None else \
        {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    if adapter is not None:  # transformers' Auto classes found an adapter's folder and give us its base
        model.load_adapter(adapter.pop("_adapter_model_path"), **adapter)
    return (model, info) if options.get("output_loading_info") else model


def _transformers_internal_options(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Take out of ``kwargs`` the keywords transformers' own Auto classes add when they call a model class's
    ``from_pretrained`` (:data:`TRANSFORMERS_INTERNAL_KWARGS`); return the adapter transformers found (its
    ``adapter_kwargs``, with ``_adapter_model_path``), if any, to put on the loaded model."""
    for key in TRANSFORMERS_INTERNAL_KWARGS:
        kwargs.pop(key, None)
    adapter = dict(kwargs.pop("adapter_kwargs", None) or {})
    return adapter if adapter.get("_adapter_model_path") else None


def _load_with_adapter(choose_class: Callable[[Family], type[PreTrainedModel]], folder: Path, caller: str,
                       options: dict[str, Any], fields: dict[str, Any]) -> Any:
    """``from_pretrained`` of a saved peft adapter's folder, as transformers loads one: the base model its
    ``adapter_config.json`` names, with the adapter put on it (transformers' ``load_adapter``: the model keeps its
    class and gains the adapter's layers, ``peft_config`` and ``disable_adapters``)."""
    from peft import PeftConfig

    base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    if not base:
        raise CheckpointError(f"adapter {folder} names no base model (base_model_name_or_path in adapter_config.json); "
                              "load the base model and call load_adapter on it")
    options = {k: v for k, v in options.items() if k != "subfolder"}  # the subfolder was the adapter's
    loaded = load_pretrained(choose_class, base, caller=caller, **options, **fields)
    model = loaded[0] if options.get("output_loading_info") else loaded
    model.load_adapter(str(folder))
    return loaded


def load_model_class(model_class: type[PreTrainedModel], name_or_path: str | os.PathLike, *model_args: Any,
                     **kwargs: Any) -> Any:
    """``model_class.from_pretrained`` for a preset or an HF checkpoint of an architecture its family converts
    (``GPTForCausalLM.from_pretrained("path/to/hf_llama")``, as ``LlamaForCausalLM.from_pretrained`` is written):
    loaded as the Auto classes load them, into ``model_class``."""

    def choose(family: Family) -> type[PreTrainedModel]:
        if not issubclass(model_class.config_class, family.config_class):
            raise ConfigError(f"{name_or_path} holds a {family.name} model; {model_class.__name__} is not one of that "
                              f"family's classes")
        return model_class

    return load_pretrained(choose, name_or_path, *model_args, caller=model_class.__name__, **kwargs)


def _generation_config(folder: Path) -> GenerationConfig:
    """The folder's ``generation_config.json``; a damaged one is a one-line CheckpointError naming it."""
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        reason = "not valid JSON" if "not a valid JSON" in str(err) else str(err).splitlines()[0]
        raise CheckpointError(f"{folder / 'generation_config.json'} cannot be read ({reason}); fix or delete it") from None


def _is_packaged(name: str | os.PathLike) -> bool:
    """Whether ``name`` is a packaged checkpoint's name whose package is installed."""
    try:
        return packaged_checkpoint_path(name) is not None
    except CheckpointError:  # its package is missing (the Hugging Face cache had it)
        return False


_PRESETS_SAID: set[str] = set()


def _say_preset(name: str) -> None:
    """Say once (per process; in a job, on its first rank) that a preset name gives a new model, not a checkpoint's
    weights."""
    if name not in _PRESETS_SAID and os.environ.get("RANK", "0") == "0":
        _PRESETS_SAID.add(name)
        logger.warning("%r is a preset of mindformers_py (a model configuration): the model gets new, randomly "
                       "initialised weights, not a checkpoint's", name)


LOADING_KWARGS = (
    "config", "dtype", "torch_dtype", "device_map", "attn_implementation", "subfolder", "ignore_mismatched_sizes",
    "output_loading_info", "use_safetensors", "low_cpu_mem_usage", "local_files_only", "revision", "trust_remote_code",
    "cache_dir", "token", "force_download", "proxies", "max_memory", "offload_folder",
)
"""transformers' ``from_pretrained`` keywords that say how to load rather than what the model is. Those that say
which files of a Hub repository are read (:data:`~mindformers_py.models.hub.HUB_KWARGS`: ``revision``,
``cache_dir``, ``local_files_only``, ``token``, ``force_download``, ``proxies``, ``subfolder``) are passed to
huggingface_hub for a hub id (:mod:`mindformers_py.models.hub`); for a local folder they change nothing, as in
transformers. ``trust_remote_code`` has no remote code to trust: our classes are this package's. ``max_memory`` and
``offload_folder`` go with ``device_map="auto"`` (see :func:`~mindformers_py.loading.placement.place`)."""
TRANSFORMERS_INTERNAL_KWARGS = ("_from_auto", "_from_pipeline", "_commit_hash", "code_revision")
"""Keywords transformers' Auto classes and pipelines pass to a model class's ``from_pretrained`` for their own
bookkeeping (besides ``adapter_kwargs``, which carries an adapter found in the folder): accepted and dropped, so a
model loaded through transformers' ``AutoModel*`` takes our route too."""
CONFIG_KWARGS = ("subfolder", "return_unused_kwargs", "trust_remote_code", *(k for k in HUB_KWARGS if k != "subfolder"))
"""transformers' ``AutoConfig.from_pretrained`` keywords that say how to load rather than what the config holds."""
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _given_config(config: Any, source: Any, overrides: dict[str, Any]) -> tuple[PretrainedConfig, Family, bool]:
    """``from_pretrained(..., config=...)``: our config object (copied, overrides applied) or a transformers config
    of an architecture we load (converted). The weights are read as the checkpoint's own ``config.json`` says
    (ours, or an HF architecture's to convert), else as the given config's architecture; the third value says
    whether they are converted from HF."""
    if isinstance(config, (str, os.PathLike)):  # a folder (or preset) holding the config, as transformers takes it
        config = resolve_config(config)[0]
    if not isinstance(config, PretrainedConfig):
        raise ConfigError(f"config={type(config).__name__} is not valid; expected a transformers PretrainedConfig or "
                          "the folder of a config.json")
    family = _family_of(getattr(config, "model_type", None), type(config).__name__)
    from_hf = config.model_type != family.config_class.model_type
    ours = _with_overrides(family.converter.config_from_hf(config.to_dict()) if from_hf else config, family, overrides)
    if isinstance(source, Path) and (source / "config.json").is_file():  # our checkpoint with an HF config, ...
        from_hf = _read_config_json(source).get("model_type") != family.config_class.model_type
    return ours, family, from_hf


def _resolve_dtype(dtype: torch.dtype | str, folder: Path, trace: Any) -> torch.dtype | None:
    """A torch dtype from ``dtype`` (transformers 5's default is ``"auto"``): ``"auto"`` is the dtype the checkpoint
    was saved in (its ``config.json``'s ``dtype``, else its first floating-point tensor's); for a preset None (the
    model's own float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if trace is None:
            return None
        saved = _read_config_json(folder)
        stored = saved.get("dtype") or saved.get("torch_dtype")
        if isinstance(stored, str) and isinstance(getattr(torch, stored, None), torch.dtype):
            return getattr(torch, stored)
        return trace.reader.floating_dtype()
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ConfigError(f"dtype={dtype!r} is not valid; expected a torch dtype, its name (e.g. 'bfloat16') or 'auto'")


class AutoModel(_AutoModel):
    """The bare model (hidden states) of a family."""

    _task = BASE


class AutoModelForCausalLM(_AutoModel):
    """A model with a language-modelling head (``generate`` ready)."""

    _task = "causal_lm"


class AutoModelForMaskedLM(_AutoModel):
    """A model with a masked-language-modelling head (``fill-mask``)."""

    _task = "masked_lm"


class AutoModelForSequenceClassification(_AutoModel):
    """A model with a sequence-classification head (``num_labels=...`` as a config override; single-label,
    multi-label or regression by ``problem_type``)."""

    _task = "sequence_classification"


class AutoModelForTokenClassification(_AutoModel):
    """A model with a per-token classification head (named entities, tagging)."""

    _task = "token_classification"


class AutoModelForQuestionAnswering(_AutoModel):
    """A model with an extractive question-answering head (answer span start and end logits)."""

    _task = "question_answering"


class AutoModelForSeq2SeqLM(_AutoModel):
    """An encoder-decoder model with a language-modelling head (``generate`` ready)."""

    _task = "seq2seq_lm"


class AutoModelForImageClassification(_AutoModel):
    """A vision model with an image-classification head."""

    _task = "image_classification"


class AutoModelForMultipleChoice(_AutoModel):
    """A model scoring the choices of (batch, choices, length) inputs (SWAG-style multiple choice)."""

    _task = "multiple_choice"


class _ExtraAutoModel(_AutoModel):
    """An Auto class for model classes that serve no training task of the registry, by the transformers Auto class
    of the same name (``Family.extra_model_classes``)."""

    _task = BASE
    _what = "model"

    @classmethod
    def _model_class(cls, family: Family) -> type[PreTrainedModel]:
        try:
            return family.extra_model_classes[cls.__name__]
        except KeyError:
            raise ConfigError(f"the {family.name} family has no {cls._what}; families with one: "
                              f"{', '.join(f.name for f in registry.FAMILIES if cls.__name__ in f.extra_model_classes)}") from None


class AutoModelForTextEncoding(_ExtraAutoModel):
    """The encoder of an encoder-decoder family alone (``T5EncoderModel``), as transformers' Auto class of that
    name: text embeddings, or a base for classifiers."""

    _what = "text-encoder model"


class AutoModelForPreTraining(_ExtraAutoModel):
    """A model with its pretraining heads (``BertForPreTraining``: masked LM and next-sentence prediction)."""

    _what = "pretraining model"


class AutoModelForNextSentencePrediction(_ExtraAutoModel):
    """A model with a next-sentence-prediction head (``BertForNextSentencePrediction``)."""

    _what = "next-sentence-prediction model"


class AutoModelForMaskedImageModeling(_ExtraAutoModel):
    """A vision model reconstructing masked patches (``ViTForMaskedImageModeling``, SimMIM)."""

    _what = "masked-image-modelling model"


EXTRA_AUTO_CLASSES: dict[str, type[_ExtraAutoModel]] = {
    cls.__name__: cls for cls in (AutoModelForTextEncoding, AutoModelForPreTraining, AutoModelForNextSentencePrediction,
                                  AutoModelForMaskedImageModeling)
}
"""Our Auto classes of the families' ``extra_model_classes``, by name."""


_AUTO_CLASSES: dict[str, type[_AutoModel]] = {
    cls._task: cls for cls in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification,
                               AutoModelForTokenClassification, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                               AutoModelForImageClassification, AutoModelForMultipleChoice)
}
assert set(_AUTO_CLASSES) == {BASE, *TASKS}, "every task of the registry has its Auto class"


def auto_class_for(task: str) -> type[_AutoModel]:
    """The Auto class of ``"base"``, a task name or alias of the task registry, or an extra model class's Auto class
    name (``"AutoModelForPreTraining"``)."""
    if task in EXTRA_AUTO_CLASSES:
        return EXTRA_AUTO_CLASSES[task]
    return _AUTO_CLASSES[task if task == BASE else get_task(task).name]


def auto_class_for_architectures(architectures: Sequence[str] | None) -> type[_AutoModel]:
    """The Auto class for a ``config.json``'s ``architectures`` (a head model's class name -> its task's Auto
    class; a base model, or none given -> :class:`AutoModel`)."""
    spec = task_for_architectures(architectures)
    return AutoModel if spec is None else _AUTO_CLASSES[spec.name]


__all__ = ["AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageClassification", "AutoModelForMaskedLM",
           "AutoModelForMaskedImageModeling", "AutoModelForMultipleChoice", "AutoModelForNextSentencePrediction",
           "AutoModelForPreTraining", "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
           "AutoModelForTextEncoding", "AutoModelForTokenClassification", "auto_class_for", "auto_class_for_architectures", "resolve_config",
           "MindFormersError"]
