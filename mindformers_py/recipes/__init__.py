"""Task recipes: YAML files with model / tokenizer / data / training / parallel / generate sections."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["apply_overrides", "load_recipe", "parse_overrides"], ".loader"),
    "run_recipe": ".runner",
    **dict.fromkeys(["DataSection", "GenerateSection", "TokenizerSection"], ".sections"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
