"""The data side of context parallelism: each rank's chunks of every sequence of a batch.

A batch arrives whole on every context-parallel rank of a data-parallel replica (they read the same samples); each
keeps the tokens its layout gives it (:class:`~.layout.ContextLayout`: the load-balanced order for causal
sequences on a ring). Before cutting, what needs the whole sequence is made from it:

* **labels are shifted first** (transformers' ``shift_labels`` convention, which accelerate and trl send too):
  a causal LM scores position t against token t + 1, which may live on another rank, so ``shift_labels`` is
  computed on the whole row and split like the inputs; the loss then uses it unshifted;
* **multi-token prediction's inputs and targets** likewise (a model whose ``tokens_ahead`` is ``D`` > 0): module
  ``k`` embeds token t + k and scores against token t + k + 1 at position t, so ``mtp_input_ids`` and
  ``mtp_shift_labels`` (B, T, D) are made on the whole row and cut like the inputs;
* **positions are the whole sequence's**: ``position_ids`` 0..T-1 (or the model's own numbering: BERT's offset,
  RoBERTa's count of real tokens) are made before cutting, so learned tables and RoPE see true positions (T5's
  relative buckets are computed by the attention from the layout);
* an encoder-decoder's **decoder inputs** are made from the whole labels (shifted right) before cutting.

A length the layout does not divide is right-padded to its multiple: pad tokens, labels -100 (never scored), an
``attention_mask`` of zeros for bidirectional sequences (causal ones need none: no real token looks forward), and
positions that continue the row, so packed documents stay intact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...layers.embedding import padding_aware_position_ids
from ...layers.loss import IGNORE_INDEX
from ...layers.multi_token_prediction import targets_ahead, tokens_ahead
from .layout import ContextLayout

# Batch keys holding one value per token of the model's input sequence, and what padding fills them with (None:
# the key's own rule below).
INPUT_KEYS = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0, "position_ids": None,
              "shift_labels": IGNORE_INDEX, "special_tokens_mask": 1, "mtp_input_ids": None,
              "mtp_shift_labels": IGNORE_INDEX}
# The same for an encoder-decoder's target sequence.
DECODER_KEYS = {"decoder_input_ids": None, "decoder_attention_mask": 0}


@dataclasses.dataclass
class StreamSpec:
    """How one sequence of a batch (the model's input, or an encoder-decoder's target) is split.

    Attributes:
        causal: its attention is causal (the ring then uses the load-balanced layout).
        pad_token_id: the token id of padding.
        positions: how whole-sequence ``position_ids`` are made when the batch has none: ``"arange"`` (0..T-1 plus
            ``first_position``), ``"padding_aware"`` (RoBERTa's count of real tokens) or None (the model takes no
            positions).
        first_position: offset of the first position (BERT-style models).
    """

    causal: bool
    pad_token_id: int = 0
    positions: str | None = "arange"
    first_position: int = 0


@dataclasses.dataclass
class BatchSharding:
    """Everything needed to cut a batch for one context-parallel rank.

    Attributes:
        cp_rank: this rank's index in the context-parallel group.
        ring, ulysses: the algorithm's group sizes (their product is the context-parallel size).
        source: the model input's sequence, or None when the model cuts its own sequence (images: the model's
            embedding output is cut instead).
        target: an encoder-decoder's target sequence, or None.
        shift_labels: the task is a causal LM whose labels must be shifted before cutting.
        token_labels: ``labels`` hold one entry per token of the input (masked LM, token classification).
        decoder_inputs: makes the decoder's inputs from whole labels (an encoder-decoder), or None.
        tokens_ahead: multi-token prediction's depth (the model's ``tokens_ahead``; 0: none): its tokens and targets
            ahead are made from the whole labelled rows before cutting.
    """

    cp_rank: int
    ring: int
    ulysses: int
    source: StreamSpec | None
    target: StreamSpec | None = None
    shift_labels: bool = False
    token_labels: bool = False
    decoder_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None
    tokens_ahead: int = 0

    def layout(self, length: int, causal: bool) -> ContextLayout:
        """The layout of a sequence of ``length`` tokens (already padded to its multiple)."""
        return ContextLayout(length, self.ring, self.ulysses, balanced=causal and self.ring > 1)

    def multiple(self, causal: bool) -> int:
        """What a sequence's length is padded to a multiple of."""
        cp = self.ring * self.ulysses
        return 2 * cp if causal and self.ring > 1 else cp


def shard_batch(batch: Mapping[str, Any], sharding: BatchSharding) -> dict[str, Any]:
    """This rank's part of ``batch``: every per-token tensor of the input (and target) sequence cut to the rank's
    chunks, after shifting labels, making positions and decoder inputs and padding as the module docstring says.
    Per-sequence tensors (classification labels, answer spans) and everything else pass unchanged."""
    out = dict(batch)
    if sharding.source is None:
        return out
    ids = out.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ConfigError("context parallelism splits the batch's input_ids (batch, tokens); this batch has none "
                          "(pass input_ids rather than inputs_embeds)")
    source_keys = dict(INPUT_KEYS)
    if sharding.token_labels and isinstance(out.get("labels"), torch.Tensor):
        source_keys["labels"] = IGNORE_INDEX
    if sharding.tokens_ahead and isinstance(out.get("labels"), torch.Tensor) and "mtp_shift_labels" not in out:
        out["mtp_input_ids"] = tokens_ahead(ids, sharding.tokens_ahead)
        out["mtp_shift_labels"] = targets_ahead(out["labels"], sharding.tokens_ahead)
    if sharding.shift_labels and isinstance(out.get("labels"), torch.Tensor) and "shift_labels" not in out:
        out["shift_labels"] = F.pad(out["labels"], (0, 1), value=IGNORE_INDEX)[..., 1:]
        source_keys["labels"] = IGNORE_INDEX
    _add_positions(out, sharding.source)
    target_keys: dict[str, Any] = {}
    if sharding.target is not None:
        target_keys = dict(DECODER_KEYS, labels=IGNORE_INDEX)
        if "decoder_input_ids" not in out and isinstance(out.get("labels"), torch.Tensor):
            if sharding.decoder_inputs is None:
                raise ConfigError("context parallelism needs decoder_input_ids, or labels and a model that makes them")
            out["decoder_input_ids"] = sharding.decoder_inputs(out["labels"])
    _check_keys(out, ids.shape[1], set(source_keys) | set(target_keys), "input_ids")
    _cut(out, source_keys, sharding.source, sharding, ids.shape[1])
    if sharding.target is not None:
        decoder = out.get("decoder_input_ids")
        if isinstance(decoder, torch.Tensor):
            _cut(out, target_keys, sharding.target, sharding, decoder.shape[1])
    return out


def _add_positions(batch: dict[str, Any], stream: StreamSpec) -> None:
    if stream.positions is None or isinstance(batch.get("position_ids"), torch.Tensor):
        return
    ids = batch["input_ids"]
    if stream.positions == "padding_aware":
        batch["position_ids"] = padding_aware_position_ids(ids, stream.pad_token_id)
    else:
        positions = torch.arange(stream.first_position, stream.first_position + ids.shape[1], device=ids.device)
        batch["position_ids"] = positions.expand(ids.shape[0], -1)


def _check_keys(batch: Mapping[str, Any], length: int, known: set[str], what: str) -> None:
    """Refuse per-token tensors whose meaning context parallelism does not know (cutting them blindly could pair
    them with the wrong tokens)."""
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length and key not in known \
                and key not in ("labels",):
            raise ConfigError(f"context parallelism cannot split the batch key {key!r} ({tuple(value.shape)}, one value "
                              f"per token of {what}); it splits: {', '.join(sorted(known))}")


def _cut(batch: dict[str, Any], keys: Mapping[str, Any], stream: StreamSpec, sharding: BatchSharding,
         length: int) -> None:
    """Pad the stream's tensors to the layout's multiple, then keep this rank's tokens of each."""
    extra = -length % sharding.multiple(stream.causal)
    if extra and not stream.causal and "attention_mask" in keys and "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    layout = sharding.layout(length + extra, stream.causal)
    index = layout.indices(sharding.cp_rank)
    for key, fill in keys.items():
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[1] != length:
            continue
        if extra:
            value = _pad(value, extra, key, fill, stream)
        batch[key] = value.index_select(1, index.to(value.device)).contiguous()


def _pad(value: torch.Tensor, extra: int, key: str, fill: Any, stream: StreamSpec) -> torch.Tensor:
    if key == "position_ids":  # the row's positions go on: the padding joins the last document, behind it
        last = value[:, -1:]
        return torch.cat([value, last + torch.arange(1, extra + 1, device=value.device)], dim=1)
    if fill is None:  # token ids
        fill = stream.pad_token_id
    return F.pad(value, (0, 0) * (value.ndim - 2) + (0, extra), value=fill)  # along the tokens (dimension 1)
