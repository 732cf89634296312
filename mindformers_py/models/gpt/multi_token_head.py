"""DeepSeek-V3's multi-token prediction on the GPT family's causal-LM model (``GPTConfig.use_mtp``).

:class:`~mindformers_py.layers.multi_token_prediction.MultiTokenPrediction` holds ``num_nextn_predict_layers``
modules whose blocks are built as the model's last decoder layer is (latent attention, an MoE block behind the same
router when that layer routes), numbered ``num_hidden_layers + k - 1`` as the checkpoint numbers them. They read the
main model's last hidden states before its final norm, its embedding and its output head (shared, not copied), and
attend with the mask and rotary positions of the main model's last layer. Under pipeline parallelism they run on
the last stage, which holds a copy of the embedding (its gradient summed with the first stage's, as for tied
embeddings); their logits leave the stage beside the main logits and the loss is taken from them there
(``GPTForCausalLM.carried_loss``). Their loss
(:func:`~mindformers_py.layers.multi_token_prediction.mtp_loss`, weighted by ``mtp_loss_weight``) is added to the
main loss when ``labels`` are given; generation (no labels) never runs them, so the main model's logits are
transformers' either way.

The MoE block's router statistics are not turned into a balance loss (DeepSeek-V3's report states its sequence-wise
balance loss for the main model's layers); its deepseek_v3 router still counts loads, so its selection bias moves
with the others'.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import MindFormersError
from ...layers import TransformerBlock
from ...layers.moe.layer import MoE
from ...layers.multi_token_prediction import MultiTokenPrediction, mtp_loss
from .configuration_gpt import GPTConfig


def build_multi_token_prediction(config: GPTConfig) -> MultiTokenPrediction:
    """``config.num_nextn_predict_layers`` MTP modules whose blocks are built as the model's last layer."""
    last = config.num_hidden_layers - 1
    routed = last in set(config.moe_layers())

    def block(k: int) -> TransformerBlock:
        mlp = MoE.from_config(config) if routed else None
        return TransformerBlock(config, config.num_hidden_layers + k - 1, mlp=mlp)

    mtp = MultiTokenPrediction(config.hidden_size, config.num_nextn_predict_layers, block, config.norm_eps)
    mtp._tp_plan = multi_token_tp_plan(config)  # merged into the model's ``tp_plan`` under ``mtp.`` by post_init
    return mtp


def multi_token_tp_plan(config: GPTConfig) -> dict[str, str]:
    """How tensor parallelism splits the MTP modules (names relative to ``mtp``): each block as the main stack's
    layers (the base plan's ``layers.*.`` entries, under ``layers.*.block.``; entries naming modules the block lacks
    match nothing), ``eh_proj`` by its output features with the output gathered (``colwise_rep``: the block's input
    is whole on every rank, as the main stack's residual stream is), the norms whole as the main stack's."""
    layer = "layers.*."
    plan = {f"{layer}block.{key[len(layer):]}": style for key, style in config.base_model_tp_plan.items()
            if key.startswith(layer)}
    return {f"{layer}eh_proj": "colwise_rep", **plan}


def multi_token_logits(model: Any, inputs: dict[str, Any], input_ids: torch.Tensor | None,
                       ahead_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each MTP module's logits (B, T, V) of a causal-LM model (``model.mtp``, ``model.model.embed_tokens``,
    ``model.lm_head``) from the base model's ``mtp_inputs`` (pre-norm hidden states, the last layer's mask and rotary
    positions, the MoE token mask); ``ahead_ids`` (B, T, D): the tokens each module embeds, when the batch carries
    them (``mtp_input_ids``: a context-parallel rank's chunks), else made from ``input_ids``."""
    if input_ids is None and ahead_ids is None:
        raise MindFormersError("multi-token prediction (use_mtp) needs input_ids with labels: it embeds the tokens "
                               "ahead; pass input_ids instead of inputs_embeds, or set use_mtp=False")
    logits, _ = model.mtp(inputs["hidden_states"], input_ids, model.model.embed_tokens, model.lm_head,
                          ahead_ids=ahead_ids, attention_mask=inputs["attention_mask"],
                          position_embeddings=inputs["position_embeddings"], token_mask=inputs["token_mask"])
    return logits


def multi_token_prediction_loss(model: Any, logits: list[torch.Tensor], labels: torch.Tensor | None,
                                num_items_in_batch: int | torch.Tensor | None, counted: bool = True,
                                targets: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted MTP loss of a causal-LM model from its MTP modules' ``logits`` and the labels aligned with the
    inputs (or each module's ``targets`` (B, T, D) aligned with the positions, when the batch carries them:
    ``mtp_shift_labels``); counted for the Trainer's logs in training (unless ``counted`` is False: a pipeline's
    placeholder call)."""
    loss = mtp_loss(logits, labels, model.config.mtp_loss_weight, num_items_in_batch, targets=targets)
    if counted and model.training and model.mtp_metrics is not None:
        model.mtp_metrics.add(loss)
    return loss


class MTPMetrics:
    """Running sum of the weighted MTP loss of the training forwards between two logs (a ``training_metrics``
    hook, see :class:`~mindformers_py.layers.moe.layer.RouterMetrics`): logged as ``mtp_loss`` per step."""

    postfix_keys = ("mtp_loss",)

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0

    @torch.no_grad()
    def add(self, loss: torch.Tensor) -> None:
        value = loss.detach().double()
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def pop(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        out = {"mtp_loss": (self._sum if self._sum is not None else torch.zeros((), dtype=torch.float64)).to(device),
               "mtp_forwards": torch.tensor(float(self._count), dtype=torch.float64, device=device)}
        self._sum, self._count = None, 0
        return out

    def summarize(self, sums: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
        if not float(sums["mtp_forwards"]):
            return {}
        return {"mtp_loss": float(sums["mtp_loss"]) / max(steps, 1)}


class MetricsGroup:
    """Several ``training_metrics`` hooks as one (an MoE model's router metrics and the MTP loss): their sums side
    by side (distinct keys), their logs merged."""

    def __init__(self, *trackers: Any) -> None:
        self.trackers = trackers
        self.postfix_keys = tuple(key for tracker in trackers for key in tracker.postfix_keys)

    def pop(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {key: value for tracker in self.trackers for key, value in tracker.pop(device).items()}

    def summarize(self, sums: dict[str, torch.Tensor], steps: int) -> dict[str, float]:
        return {key: value for tracker in self.trackers for key, value in tracker.summarize(sums, steps).items()}
