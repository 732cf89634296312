"""peft adapters (LoRA, IA3, prompt tuning, ...) from recipes and the Trainer, applied by peft itself.

:mod:`.config` reads a recipe's ``peft:`` section (or MindFormers' ``pet_config:``) into peft's own config object;
:mod:`.apply` checks it against the model and wraps the model with ``peft.get_peft_model``, and reads and writes the
adapter's weights by the wrapped model's names; :mod:`.export` writes a saved adapter under transformers' module
names (through the family's converter) or merges it into a whole checkpoint; :mod:`.counting` counts an adapter's
trainable parameters for the planner. The parallel engines shard adapters with their base layers
(:mod:`mindformers_py.parallel.adapter_layers`) and save only the adapter
(:mod:`mindformers_py.engine.adapter_checkpoint`).
"""

from .apply import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, adapted_model, apply_peft, is_adapter_folder, \
    is_peft_model
from .config import PET_CONFIG, SECTION, as_peft_config, peft_config_from_dict, recipe_peft_config

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "PET_CONFIG", "SECTION", "adapted_model", "apply_peft",
           "as_peft_config", "is_adapter_folder", "is_peft_model", "peft_config_from_dict", "recipe_peft_config"]
