"""The fused causal-LM loss of a model: the linear cross-entropy kernel of
:mod:`mindformers_py.layers.loss.linear_cross_entropy` (the logits never materialised) applied from outside the model.

:class:`FusedCausalLMLoss` does it so: the model's body (``model.base_model``) gives the
hidden states, its output embedding (an ``nn.Linear``) the weight. That is only valid when the model's logits are
exactly ``lm_head(base_model(...)[0])`` and its loss is plain next-token cross-entropy, so :meth:`probe` runs the
model both ways once on a slice of the first batch and enables the fused path only when the losses agree.
The Trainer uses it when ``TrainingArguments.fused_loss`` is set.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

import torch
from torch import nn

from ..layers.loss.linear_cross_entropy import linear_cross_entropy

# The probe runs on the first sample of a batch, cut to this many tokens.
_PROBE_TOKENS = 64

logger = logging.getLogger(__name__)


class FusedCausalLMLoss:
    """The loss of a causal LM computed as ``linear_cross_entropy(body(inputs), head.weight, labels)``.

    Build it with :meth:`probe`, which returns None unless the model's own loss agrees on a sample.
    """

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        self.body = body
        self.head = head
        self._body_kwargs = {"use_cache": False} if _accepts(body, "use_cache") else {}

    def __call__(self, inputs: Mapping[str, Any], num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        """The loss of one batch (``inputs`` holds ``labels``, and maybe transformers' pre-shifted ``shift_labels``,
        which are then the targets, as the model's own loss takes them), normalised as :func:`linear_cross_entropy`."""
        body_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        hidden = self.body(**body_inputs, **self._body_kwargs)[0]
        shifted = inputs.get("shift_labels")
        targets = shifted if isinstance(shifted, torch.Tensor) else inputs["labels"]
        return linear_cross_entropy(hidden, self.head.weight, targets, num_items_in_batch, self.head.bias,
                                    shift=not isinstance(shifted, torch.Tensor))

    @classmethod
    def probe(cls, model: nn.Module, inputs: Mapping[str, Any]) -> FusedCausalLMLoss | None:
        """A fused loss for ``model`` if its loss on (a slice of) ``inputs`` equals the fused one, else None."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        body = getattr(model, "base_model", None)
        labels = inputs.get("labels")
        if not isinstance(head, nn.Linear) or not isinstance(body, nn.Module) or body is model \
                or not isinstance(labels, torch.Tensor) or labels.ndim != 2:
            return None
        fused = cls(body, head)
        sample = _probe_slice(inputs, labels.shape)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(labels.device.type, enabled=False):
                reference = model(**sample).loss
                mine = fused(sample)
            agree = reference is not None and bool(torch.allclose(reference.float(), mine, rtol=1e-4, atol=1e-5))
        except Exception as err:  # noqa: BLE001 - any failure just means the model is not of the expected shape
            logger.debug("fused causal-LM loss not applicable to %s: %s", type(model).__name__, err)
            agree = False
        finally:
            model.train(was_training)
        return fused if agree else None


class ModelFusedLoss:
    """The fused causal-LM loss made by the model itself: the Trainer calls the model whole, as usual, within
    :func:`~mindformers_py.layers.loss.fused_head.loss_without_logits` (so FSDP2's and replicate's hooks run), and
    the model computes its loss from its hidden states and head weight (no logits). ``reported``: whether the
    Trainer has logged what the first call did."""

    def __init__(self) -> None:
        self.reported = False


def _probe_slice(inputs: Mapping[str, Any], shape: torch.Size) -> dict[str, Any]:
    """The first sample of a batch, cut to ``_PROBE_TOKENS`` positions, for the tensors shaped like the labels."""
    batch, length = shape
    keep = min(length, _PROBE_TOKENS)
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == batch:
            value = value[:1]
            if value.ndim == 2 and value.shape[1] == length:
                value = value[:, :keep]
        out[key] = value
    return out


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
