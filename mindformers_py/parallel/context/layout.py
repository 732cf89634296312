"""Which tokens of a sequence each context-parallel rank holds.

A sequence of ``length`` tokens is split over ``ring x ulysses`` ranks, rank ``c = g * ulysses + m`` being member
``m`` of Ulysses group ``g`` (the ring index). The ring's share of group ``g`` is one contiguous chunk of the
sequence, or, for a **balanced** (causal) layout, the pair of chunks ``g`` and ``2·ring-1-g`` of ``2·ring`` equal
chunks: under a causal mask the early chunk has little to attend to and the late one much, so every ring rank does
the same work (torch's head-tail load balancer, whose order is reused here). Each group's share is then cut
contiguously over its Ulysses members. Without a ring (Ulysses alone) or for bidirectional attention the layout is
plainly contiguous: Ulysses attends over the whole sequence per head, so it needs no balancing.

The **order** of a layout lists the tokens rank by rank (rank 0's tokens, then rank 1's, ...), which is also what
concatenating the ranks' chunks gives; ``restore`` puts such a concatenation back in sequence order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer


@dataclass(frozen=True)
class ContextLayout:
    """The split of one sequence over the context-parallel ranks.

    Attributes:
        length: tokens of the whole sequence.
        ring: ranks of the ring (1 for Ulysses alone).
        ulysses: ranks of each Ulysses group (1 for the ring alone).
        balanced: the ring's shares are head-tail chunk pairs (causal attention) instead of contiguous chunks.
    """

    length: int
    ring: int = 1
    ulysses: int = 1
    balanced: bool = False

    def __post_init__(self) -> None:
        if self.length % self.multiple:
            raise ValueError(f"a sequence of {self.length} tokens cannot be split over this layout: its length must "
                             f"be a multiple of {self.multiple}")

    @property
    def cp(self) -> int:
        """Context-parallel ranks."""
        return self.ring * self.ulysses

    @property
    def local_length(self) -> int:
        """Tokens each rank holds."""
        return self.length // self.cp

    @property
    def multiple(self) -> int:
        """What the sequence length must be a multiple of: ``2 x cp`` when balanced over a ring, else ``cp``."""
        return 2 * self.cp if self.balanced and self.ring > 1 else self.cp

    @property
    def chunk_length(self) -> int:
        """Tokens of one ring share (``length / ring``)."""
        return self.length // self.ring

    def order(self) -> torch.Tensor:
        """Sequence positions of the tokens listed rank by rank, (length,) on the CPU."""
        return _order(self.length, self.ring, self.balanced)

    def restore(self) -> torch.Tensor:
        """The permutation putting a rank-by-rank concatenation back in sequence order, (length,)."""
        return _restore(self.length, self.ring, self.balanced)

    def indices(self, rank: int) -> torch.Tensor:
        """Sequence positions of the tokens rank ``rank`` holds, in its local order, (local_length,)."""
        n = self.local_length
        return self.order()[rank * n:(rank + 1) * n]

    def ring_indices(self, ring_rank: int) -> torch.Tensor:
        """Sequence positions of the tokens Ulysses group ``ring_rank`` holds together, (chunk_length,)."""
        n = self.chunk_length
        return self.order()[ring_rank * n:(ring_rank + 1) * n]

    def ring_segments(self, ring_rank: int) -> list[tuple[int, int, int]]:
        """The contiguous runs of a ring share: ``(offset in the share, first position, stop position)`` each; one
        run, or two for a balanced share (its head and tail chunks)."""
        positions = self.ring_indices(ring_rank).tolist()
        runs, start = [], 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                runs.append((start, positions[start], positions[i - 1] + 1))
                start = i
        return runs


@functools.lru_cache(maxsize=32)
def _order(length: int, ring: int, balanced: bool) -> torch.Tensor:
    if balanced and ring > 1:
        return _HeadTailLoadBalancer(length, ring, "cpu")._generate_indices()[0].long()
    return torch.arange(length)


@functools.lru_cache(maxsize=32)
def _restore(length: int, ring: int, balanced: bool) -> torch.Tensor:
    return torch.argsort(_order(length, ring, balanced))
