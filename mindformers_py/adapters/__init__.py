"""peft adapters (LoRA, IA3, prompt tuning, ...) from recipes and the Trainer, applied by peft itself.

:mod:`.config` reads a recipe's ``peft:`` section (or MindFormers' ``pet_config:``) into peft's own config object;
:mod:`.apply` checks it against the model and wraps the model with ``peft.get_peft_model``, and reads and writes the
adapter's weights by the wrapped model's names; :mod:`.export` writes a saved adapter under transformers' module
names (through the family's converter) or merges it into a whole checkpoint; :mod:`.counting` counts an adapter's
trainable parameters for the planner; :mod:`.distributed` gathers the adapter of a model trained under any layout
into peft's files on rank 0 and loads such files back into every rank's shards. The parallel engines shard adapters
with their base layers (:mod:`mindformers_py.parallel.tensor.adapters`) and save only the adapter.
"""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    **dict.fromkeys(["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "adapter_base", "is_adapter_folder"], ".files"),
    **dict.fromkeys(["PET_CONFIG", "SECTION", "as_peft_config", "peft_config_from_dict", "recipe_peft_config"],
                    ".config"),
    **dict.fromkeys(["adapted_model", "apply_peft", "is_peft_model"], ".apply"),
    **dict.fromkeys(["export_adapter", "merged_model"], ".export"),
    "adapter_parameter_count": ".counting",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
