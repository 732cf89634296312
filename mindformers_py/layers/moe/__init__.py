"""Mixture of experts, the shared layer any family uses in place of its MLP: :mod:`.config` (``MoEConfig``, a model
config's ``moe_config`` section, with its checks) and :mod:`.layer` (the router kinds, the grouped experts, the
``MoE`` layer and the router's statistics and losses)."""
