"""Task recipes: YAML files with model / tokenizer / data / training / parallel / generate sections."""

from .loader import apply_overrides, load_recipe, parse_overrides
from .runner import run_recipe
from .sections import DataSection, GenerateSection, TokenizerSection

__all__ = ["load_recipe", "parse_overrides", "apply_overrides", "run_recipe", "DataSection", "GenerateSection", "TokenizerSection"]
