"""Mixture of experts, the shared layer any family uses in place of its MLP: :mod:`.config` (``MoEConfig``, a model
config's ``moe_config`` section, with its checks), :mod:`.router` (the softmax router every router kind subclasses),
:mod:`.sigmoid_router` (DeepSeek-V3's group-limited sigmoid router with its selection bias and load counts) and
:mod:`.layer` (the table of router kinds, the grouped experts, the ``MoE`` layer and the router's statistics and
losses)."""
