"""The loss of a causal LM with its output head folded into it (``TrainingArguments.fused_loss``), as the Trainer takes
it: the model called whole inside ``loss_without_logits``, with a check of whether the head was fused."""

from __future__ import annotations

from mindformers_py.layers.loss.fused_head import loss_without_logits


def fused_loss(model, inputs, num_items, taken: bool = True):
    """The model's loss on ``inputs`` (normalised by ``num_items``) inside ``loss_without_logits``; asserts the head
    was fused (no logits), or, with ``taken`` False, declined for the model's own loss."""
    with loss_without_logits(model) as heads:
        output = model(**inputs, num_items_in_batch=num_items)
    assert heads and all(h.fused_loss_taken == taken for h in heads) and (output.logits is None) == taken
    return output.loss
