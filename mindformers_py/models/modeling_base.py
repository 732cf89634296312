"""What every family's models share: transformers' ``PreTrainedModel`` plus the conventions our runtime relies on."""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.utils.output_capturing import OutputRecorder

from ..layers import Attention, TransformerBlock
from ..layers.moe import Router
from .registry import register_with_peft


class MindFormersPreTrainedModel(PreTrainedModel):
    """Base of every family's pretrained-model class.

    * ``accepts_loss_kwargs``: every head divides its loss by a ``num_items_in_batch`` it is given (the items of the
      whole optimizer step), so transformers' Trainer and ours pass it and do not rescale the loss.
    * ``_can_record_outputs``: transformers' output recording: ``output_hidden_states`` collects each layer's input
      and output (the last replaced by the normed last hidden state), ``output_attentions`` each attention's weights
      (computed under ``attn_implementation="eager"``, as in transformers), ``output_router_logits`` each MoE
      router's logits (tokens, experts).
    * models register the family with peft's defaults when they are built (peft may be imported after us).
    """

    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _can_record_outputs = {"hidden_states": TransformerBlock, "attentions": Attention,
                           "router_logits": OutputRecorder(Router, index=0)}
    accepts_loss_kwargs = True

    def post_init(self) -> None:
        """transformers' ``post_init`` (weights, plans), then our model types into peft's tables if it is loaded."""
        super().post_init()
        register_with_peft()
