"""LoRA on the experts of a mixture-of-experts model, by the names ``target_modules`` gives the projections.

Our experts keep each projection of all experts as one stacked parameter (``mlp.experts.gate_proj`` (E, out, in),
``up_proj``, ``down_proj``), as transformers 5 keeps its MoE experts. peft adapts such a parameter with
``target_parameters`` (its ``ParamWrapper``: a rank-r update per expert, added to the stacked weight while the
experts run), and converts a transformers 5 MoE model's ``target_modules`` naming the experts' projections to
``target_parameters`` itself. Our model types are not in peft's conversion table, so the same conversion is done
here: ``target_modules: [q_proj, gate_proj, up_proj, down_proj]`` adapts the dense MLPs' ``gate_proj`` ... (where the
model has dense layers) and every MoE layer's experts' projections of the same names, each with its own rank
(peft fuses transformers' ``gate_up_proj`` and doubles its rank; ours stay apart).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..layers.moe.layer import GroupedExperts


def with_expert_parameters(model: nn.Module, config: Any, name: str) -> Any:
    """``config`` (a peft config) with the experts' stacked projections that its ``target_modules`` names added to
    ``target_parameters`` (a copy; ``config`` itself when nothing changes). The names stay in ``target_modules``
    where the model also has modules of that name (a dense layer's MLP), else they leave it (peft would refuse a
    name that matches no module)."""
    targets = getattr(config, "target_modules", None)
    if getattr(config, "peft_type", None) is None or not targets or isinstance(targets, str):
        return config
    projections = sorted({attr for module in model.modules() if isinstance(module, GroupedExperts)
                          for attr, _ in module.named_parameters(recurse=False)})
    named = [target for target in targets if target.rsplit(".", 1)[-1] in projections]
    if not named:
        return config
    modules = [n for n, _ in model.named_modules() if n]
    if str(config.peft_type.value) != "LORA":
        # peft adapts parameters (target_parameters) with LoRA alone; its other adapters wrap modules, and stacked
        # experts have none per projection (transformers 5's MoE models alike). Where a dense layer has a module of
        # that name, the name adapts that module and the experts stay frozen, as peft does on transformers' models.
        alone = [t for t in named if not any(n == t or n.endswith(f".{t}") for n in modules)]
        if alone:
            kind = str(config.peft_type.value).lower()
            raise ConfigError(f"{name}.target_modules names the experts' projections ({', '.join(sorted(alone))}), "
                              f"which type={kind} cannot adapt: peft adapts stacked expert weights with LoRA only "
                              "(target_parameters); use type: lora, or leave them out")
        return config
    if config.lora_dropout:
        raise ConfigError(f"{name}.lora_dropout={config.lora_dropout} is not valid with the experts' projections "
                          f"in target_modules ({', '.join(named)}): peft's LoRA on stacked expert weights takes no "
                          "dropout; set lora_dropout=0 or leave the experts' projections out")
    config = copy.copy(config)
    parameters = set(config.target_parameters or ())
    parameters |= {f"experts.{target.rsplit('.', 1)[-1]}" for target in named}
    config.target_parameters = sorted(parameters)
    config.target_modules = {t for t in targets if t not in named or any(n == t or n.endswith(f".{t}") for n in modules)}
    return config
