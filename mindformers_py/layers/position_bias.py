"""Relative position bias (T5): a learned scalar per head for each bucket of query-key distances, added to the
attention scores instead of position embeddings.

Distances are bucketed as in Mesh TensorFlow's T5 (Raffel et al., 2020): half of the buckets hold exact small
distances, the other half logarithmically wider ranges up to ``max_distance``, beyond which all distances share
the last bucket. Encoders look both ways (each direction has half of the buckets); decoders only back. The bias
is computed once per stack and shared by all of its layers.

Tensor parallelism shards the table by heads (``colwise`` on ``relative_attention_bias``: the embedding's
columns are the heads), matching the query/key/value projections sharded by heads, so each rank gets the bias of
its own heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Bucket index in ``[0, num_buckets)`` of each ``relative_position`` (key position minus query position).

    With ``bidirectional`` the keys after the query take the upper half of the buckets; otherwise keys after the
    query (which a causal decoder never sees) fall in bucket 0 with the query itself.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # Distances from `exact` to `max_distance` are spread over the remaining buckets on a log scale.
    logarithmic = exact + (
        torch.log(distance.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).long()
    logarithmic = logarithmic.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, logarithmic)


class RelativePositionBias(nn.Module):
    """``forward(query_length, key_length, past_length)`` -> the bias (1, num_heads, query_length, key_length) for
    queries at positions ``past_length ...`` against keys at ``0 ... key_length - 1``.

    Args:
        num_heads: attention heads (one learned value per head and bucket).
        num_buckets: number of distance buckets.
        max_distance: distances from here on share the last bucket.
        bidirectional: encoder (True) or causal decoder (False) bucketing.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def forward(self, query_length: int, key_length: int, past_length: int = 0) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        queries = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_length
        keys = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(keys - queries, self.bidirectional, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias(buckets)  # (q, k, nh): with tensor parallelism, this rank's heads
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, nh, q, k)

    def extra_repr(self) -> str:
        return f"buckets={self.num_buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional}"
