"""Tensor parallelism: the plans the models declare applied to DTensor placements (:mod:`.plans`), the same for
peft adapters' layers on the planned modules (:mod:`.adapters`), and the sequences padded to a multiple of
``model_parallel`` for sequence parallelism (:mod:`.sequence_padding`)."""

from .plans import PLAN_STYLES, SEQUENCE_SCATTER_MODULE, _whole_sequence_modules, apply_tensor_parallel, tp_plan_of

__all__ = ["PLAN_STYLES", "SEQUENCE_SCATTER_MODULE", "apply_tensor_parallel", "tp_plan_of"]
