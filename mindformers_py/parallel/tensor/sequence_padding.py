"""Sequences padded to a length sequence parallelism can split.

Sequence parallelism (``use_seq_parallel``) cuts the residual stream of every sequence into ``model_parallel`` equal
shards between sublayers, so a batch's sequence length must be a multiple of ``model_parallel``. Batches padded to
their longest row (a classification task), or blocks of an odd ``block_size``, are not: :func:`pad_sequences`
pads each sequence at its end, as a tokenizer's right padding would, with what every layout already ignores:
the pad token in the inputs, 0 in the attention mask (made for an input without one), -100 in the labels. Real
tokens then compute exactly what they compute unpadded (a padding position is masked out of bidirectional
attention, and comes after them in causal attention), and the loss, its item count and the throughput count
exclude the padding. An encoder-decoder's source and target are padded each to its own multiple.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SequenceGroup:
    """Tensors of a batch that share one sequence length (an encoder-decoder has two: source and target).

    Attributes:
        keys: the batch keys of the group's ``(B, T, ...)`` tensors.
        fill: the padding value of each key (keys not named get 0; ``position_ids`` continue counting).
        mask: the group's attention-mask key, made (ones, then zeros on the padding) when the batch has none; None
            for a causal side, whose real tokens never see the padding after them.
    """

    keys: tuple[str, ...]
    fill: Mapping[str, int]
    mask: str | None = None


def pad_sequences(batch: Mapping[str, Any], multiple: int, groups: Sequence[SequenceGroup]
                  ) -> tuple[dict[str, Any], list[tuple[int, int] | None]]:
    """``batch`` with each group's sequences padded at the end to a multiple of ``multiple``, and for each group its
    ``(length, padded length)``, or None where nothing needed padding."""
    out = dict(batch)
    lengths: list[tuple[int, int] | None] = []
    for group in groups:
        present = [k for k in group.keys if isinstance(out.get(k), torch.Tensor) and out[k].ndim >= 2]
        length = out[present[0]].shape[1] if present else 0
        extra = -length % multiple
        if not extra:
            lengths.append(None)
            continue
        if group.mask is not None and group.mask not in present:
            rows = out[present[0]].shape[0]
            out[group.mask] = torch.ones(rows, length, dtype=torch.long, device=out[present[0]].device)
            present.append(group.mask)
        for key in present:
            value = out[key]
            if value.shape[1] != length:
                continue
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
            else:
                tail = value.new_full((value.shape[0], extra, *value.shape[2:]), group.fill.get(key, 0))
            out[key] = torch.cat([value, tail], dim=1)
        lengths.append((length, length + extra))
    return out, lengths


def cut_sequences(output: Any, lengths: Mapping[str | None, tuple[int, int]]) -> Any:
    """A model's ``output`` (a ``ModelOutput`` or mapping) with its tensors cut back along the sequence to the
    unpadded length: ``lengths`` maps an output-name prefix (``"encoder"``: an encoder-decoder's source side) or
    None (every other output) to ``(length, padded length)``; a tensor whose second dimension is not that padded
    length is left as it is."""
    if not lengths or not isinstance(output, Mapping):
        return output
    for key, value in list(output.items()):
        side = next((v for prefix, v in lengths.items() if prefix is not None and key.startswith(prefix)),
                    lengths.get(None))
        if side is not None and isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == side[1]:
            output[key] = value[:, :side[0]]
    return output
