"""Where a model name points, for every ``from_pretrained`` of ours (configs and models alike) and the recipes.

In this order, as transformers reads a name: a local folder; a checkpoint shipped inside an installed package
(:mod:`.packaged`); a preset of ours (a config: a new model with randomly initialised weights, never a checkpoint;
their names, ``gpt_tiny``, ``llama_1b``, ``bert_base``, are not hub ids); anything else is a repository id on the
Hugging Face Hub (``org/name``, or a legacy name such as ``gpt2``), whose files come from the local Hugging Face
cache, downloaded there first where the network allows. huggingface_hub resolves it (``snapshot_download``: the
cache layout, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``/``HF_HOME``, revisions, tokens), with transformers' loading
keywords passed through (:data:`HUB_KWARGS`), so a model id behaves as in transformers and no file is read from
anywhere else.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from . import registry
from .packaged import packaged_checkpoint_path

HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "force_download", "proxies", "subfolder")
"""transformers' ``from_pretrained`` keywords that say which files of a hub repository are read: passed to
huggingface_hub for a hub id (``subfolder`` also applies to a local folder)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "chat_template.jinja")
"""A repository's tokenizer files (transformers' names)."""
CHECKPOINT_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "model.safetensors",
                    "model.safetensors.index.json", "model-*-of-*.safetensors", *TOKENIZER_FILES)
"""The files of a repository that loading a model reads (transformers' names): downloaded, the rest of the
repository (pickled ``.bin`` weights, other frameworks' weights, ``consolidated.safetensors``) is not."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hub_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove :data:`HUB_KWARGS` from ``kwargs`` and return them (those set to something other than None/False/"")."""
    taken = {key: kwargs.pop(key) for key in HUB_KWARGS if key in kwargs}
    return {key: value for key, value in taken.items() if value not in (None, False, "")}


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id (``name`` or ``org/name``)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def resolve_source(name_or_path: str | os.PathLike, files: tuple[str, ...] = CHECKPOINT_FILES,
                   **options: Any) -> str | os.PathLike:
    """The local folder (or preset name) behind ``name_or_path``: a local folder as given, a packaged checkpoint's
    folder, a preset name as given, or the folder of a hub repository's snapshot in the Hugging Face cache (its
    ``files`` downloaded first where the network allows). ``options`` are :data:`HUB_KWARGS`; ``subfolder`` is
    left for the caller to join (it applies to local folders too). A hub id that cannot be had is a one-line
    error saying how to get it; a preset is never what a hub id resolves to."""
    options = {key: value for key, value in options.items() if value not in (None, False, "")}
    unknown = sorted(set(options) - set(HUB_KWARGS))
    if unknown:
        raise ConfigError(f"{unknown[0]!r} is not a hub option; they are: {', '.join(HUB_KWARGS)}")
    if not isinstance(name_or_path, str) or Path(name_or_path).exists():
        return name_or_path
    try:
        folder = packaged_checkpoint_path(name_or_path)
    except CheckpointError as not_installed:  # its package is missing: the Hugging Face cache may hold it
        try:
            return _snapshot(name_or_path, files, options)
        except (CheckpointError, ConfigError):
            raise not_installed from None  # (the package's install command is the simplest way to get it)
    if folder is not None:
        return str(folder)
    if registry.is_preset(name_or_path):
        return name_or_path
    if not is_hub_id(name_or_path):
        raise ConfigError(f"no such folder: {name_or_path!r} (expected a checkpoint folder, a preset name or a "
                          "Hugging Face Hub id such as 'org/name')")
    return _snapshot(name_or_path, files, options)


def _snapshot(repo_id: str, files: tuple[str, ...], options: dict[str, Any]) -> str:
    """The cached snapshot folder of ``repo_id`` (downloading its loading files where allowed)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if options.get("proxies") is not None:
        raise ConfigError("proxies=... is not taken by huggingface_hub 1.x and later, which downloads through the "
                          "proxy named by the HTTPS_PROXY / HTTP_PROXY environment variables; set those instead")
    subfolder = options.get("subfolder")
    patterns = [f"{subfolder}/{name}" if subfolder else name for name in files]
    revision = options.get("revision")
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=options.get("cache_dir"),
                                   local_files_only=bool(options.get("local_files_only")), token=options.get("token"),
                                   force_download=bool(options.get("force_download")), allow_patterns=patterns)
    except GatedRepoError:
        raise CheckpointError(f"{repo_id!r} is a gated repository on the Hugging Face Hub: accept its terms on its "
                              "page, then pass token=... (or log in with `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{repo_id!r} is no local folder, no preset{_close_preset(repo_id)} and no repository "
                              "on the Hugging Face Hub (or a private one: pass token=... or log in with `hf auth "
                              "login`)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"revision={revision!r} is no branch, tag or commit of {repo_id!r} on the Hugging Face "
                              "Hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        cache = options.get("cache_dir") or constants.HF_HUB_CACHE
        at = f"@{revision}" if revision else ""
        why = ("local_files_only=True" if options.get("local_files_only") else
               "downloads are off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the Hub could not be reached")
        get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") + \
            (f" --cache-dir {cache}" if options.get("cache_dir") else "")
        raise ConfigError(f"{repo_id!r}{at} is no local folder, no preset{_close_preset(repo_id)} and not in the "
                              f"Hugging Face cache ({cache}), and {why}; get its weights with `{get}` where the "
                              "network is reachable, or pass a local folder") from None
    return folder


def _close_preset(name: str) -> str:
    """The preset a name without an organisation may have meant, else the presets; nothing for ``org/name``."""
    if "/" in name:
        return ""
    presets = registry.all_presets()
    close = difflib.get_close_matches(name, presets, n=1)
    return f" (did you mean the preset {close[0]!r}?)" if close else f" (presets: {', '.join(presets)})"
