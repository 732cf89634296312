"""A frozen output head split by vocabulary rows over the data-parallel ranks (``ParallelConfig.shard_frozen_head``).

In an adapter's run (LoRA) the output head does not train, and data or expert parallelism keeps it whole on every
rank: at Qwen3's 151,936-token vocabulary and width 2048 that is 0.58 GiB of bf16 a rank, the largest tensor a
Qwen3-MoE rank holds once its experts are split. Here its rows are split over the ranks of the batch mesh (data x
context parallel), each rank reading only its rows from the checkpoint; the head's weight becomes a DTensor
(``Shard(0)``) and the head is marked (:data:`~mindformers_py.layers.loss.fused_head.ROWS_OVER_BATCH`).

The fused loss (``TrainingArguments.fused_loss``; :func:`~mindformers_py.layers.loss.linear_cross_entropy.
vocab_parallel_linear_cross_entropy` with ``gather_tokens``) then scores every rank's tokens against each rank's
rows: the hidden states are all-gathered over the ranks (ranks x tokens x hidden), each chunk's softmax statistics
all-reduced, and the hidden states' gradient reduce-scattered back to the rank whose tokens they are. The products are those of a whole head,
spread over the ranks; what crosses between them is the tokens' hidden states, not the weight (ZeRO-3 would gather
the whole head every step). Called any other way (logits for metrics, multi-token prediction's modules), the head
gathers its weight whole for that call (:class:`RowShardedHead`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..errors import ConfigError
from ..layers.loss.fused_head import ROWS_OVER_BATCH


class RowShardedHead(nn.Linear):
    """An output head whose frozen weight is a DTensor of rows over the batch mesh (:func:`shard_frozen_head` gives a
    head this class). Its own forward, taken outside the fused loss, gathers the weight whole for the call."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        return F.linear(input, self.weight.full_tensor().to(input.dtype), self.bias)


def shard_frozen_head(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split the output head of ``model`` (or of the model a peft model adapts) by rows over the 1-D ``mesh`` (the
    batch mesh); the head must be a frozen ``nn.Linear`` of its own (untied, no bias). A head still on ``meta``
    (a model built for its layout) gets its rows when the model is materialised. Returns the head."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if type(head) is not nn.Linear:
        what = "no output head" if head is None else \
            f"its output head is a {type(head).__module__}.{type(head).__qualname__}"
        raise ConfigError(f"shard_frozen_head=True splits a causal LM's frozen nn.Linear head; {what} (peft adapts "
                          "it when target_modules names it); set shard_frozen_head to false")
    embedding = inner.get_input_embeddings() if callable(getattr(inner, "get_input_embeddings", None)) else None
    if embedding is not None and getattr(embedding, "weight", None) is head.weight:
        raise ConfigError("shard_frozen_head=True needs an untied output head (tie_word_embeddings=False): this one is "
                          "the input embedding's table; set shard_frozen_head to false")
    if head.weight.requires_grad:
        raise ConfigError("shard_frozen_head=True splits a frozen output head (an adapter's run); this head trains; "
                          "set shard_frozen_head to false, or freeze it")
    if head.bias is not None:
        raise ConfigError("shard_frozen_head=True splits an output head without a bias; this one has a bias; set "
                          "shard_frozen_head to false")
    rows = distribute_tensor(head.weight.detach(), mesh, [Shard(0)])  # (on meta: the shape of this rank's rows)
    head.weight = nn.Parameter(rows, requires_grad=False)
    head.__class__ = RowShardedHead
    setattr(head, ROWS_OVER_BATCH, True)
    return head


__all__ = ["RowShardedHead", "shard_frozen_head"]
