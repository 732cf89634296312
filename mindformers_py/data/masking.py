"""Masked-language-modelling batches whose masks depend only on the seed and each sample, never on the layout.

transformers' ``DataCollatorForLanguageModeling`` draws the masks of a batch from one random stream, so which
tokens are masked depends on how the global batch is cut into micro-batches and data-parallel shares. Here each
sample's mask comes from its own generator, seeded by the collator's ``seed`` and a digest of the sample's token
ids: the same sample is masked the same way in every layout (dp, tp, pp, ZeRO, gradient accumulation) and every
epoch, and evaluation losses are repeatable. BERT's rule is kept: ``mlm_probability`` of the non-special tokens
are chosen; 80% of them become the mask token, 10% a random token, 10% stay; the labels hold the chosen tokens'
ids and -100 elsewhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from transformers import DataCollatorForTokenClassification, PreTrainedTokenizerBase, default_data_collator

from ..errors import ConfigError, MindFormersError
from ..layers.loss import IGNORE_INDEX


def sample_generator(token_ids: Sequence[int], seed: int) -> torch.Generator:
    """A generator seeded by ``seed`` and the sample's token ids (a stable digest, the same in every process)."""
    digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8,
                             key=int(seed).to_bytes(8, "little", signed=True)).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def mask_sample(token_ids: Sequence[int], special: Sequence[bool], *, mask_token_id: int, vocab_size: int, seed: int,
                mlm_probability: float = 0.15, mask_replace_prob: float = 0.8,
                random_replace_prob: float = 0.1) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one sample: BERT's masking of the positions not flagged ``special``, drawn from
    :func:`sample_generator` ``(token_ids, seed)``."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    g = sample_generator(token_ids, seed)
    chosen = (torch.rand(ids.shape, generator=g) < mlm_probability) & ~torch.as_tensor(list(special), dtype=torch.bool)
    labels = ids.masked_fill(~chosen, IGNORE_INDEX)
    draw = torch.rand(ids.shape, generator=g)
    random_ids = torch.randint(vocab_size, ids.shape, generator=g)
    masked = ids.clone()
    masked[chosen & (draw < mask_replace_prob)] = mask_token_id
    swap = chosen & (draw >= mask_replace_prob) & (draw < mask_replace_prob + random_replace_prob)
    masked[swap] = random_ids[swap]
    return masked.tolist(), labels.tolist()


@dataclass
class DataCollatorForMaskedLM:
    """Collate examples for masked language modelling with per-sample masks (see the module docstring).

    Examples without ``labels`` are masked here; examples that already have ``labels`` (masked beforehand) are only
    padded. Padding uses the tokenizer (``input_ids`` with its pad token, ``attention_mask``/``token_type_ids``
    with 0, ``labels`` with -100); without a tokenizer, examples of equal length with labels are stacked.
    """

    tokenizer: PreTrainedTokenizerBase | None = None
    """Tokenizer giving the mask token, the vocabulary size, special tokens and padding."""
    mlm_probability: float = 0.15
    """Share of the (non-special) tokens chosen for prediction."""
    mask_replace_prob: float = 0.8
    """Share of the chosen tokens replaced by the mask token."""
    random_replace_prob: float = 0.1
    """Share of the chosen tokens replaced by a random token (the rest stay as they are)."""
    seed: int = 0
    """Seed of every sample's masking generator."""
    pad_to_multiple_of: int | None = None
    """Round the padded length up to a multiple of this; None pads to the longest example."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mlm_probability < 1.0:
            raise ConfigError(f"mlm_probability={self.mlm_probability!r} is not valid; use a number in (0, 1)")
        if self.mask_replace_prob < 0 or self.random_replace_prob < 0 or self.mask_replace_prob + self.random_replace_prob > 1:
            raise ConfigError(f"mask_replace_prob={self.mask_replace_prob!r} and random_replace_prob="
                              f"{self.random_replace_prob!r} must be >= 0 and sum to at most 1")
        if self.tokenizer is not None and self.tokenizer.mask_token_id is None:
            raise MindFormersError(f"tokenizer {type(self.tokenizer).__name__} has no mask token, so it cannot prepare "
                                   "masked-LM batches; use a tokenizer with a mask_token (BERT's [MASK])")

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate ``examples`` into a dict of tensors with ``labels``."""
        if not examples:
            raise MindFormersError("cannot collate an empty list of examples")
        rows = [{k: _as_list(v) for k, v in ex.items()} for ex in examples]
        if any(row.get("labels") is None for row in rows):
            if self.tokenizer is None:
                raise MindFormersError("masking needs a tokenizer (its mask token and vocabulary); pass "
                                       "processing_class=<tokenizer> to the Trainer or examples with labels")
            rows = [self.mask(row) if row.get("labels") is None else row for row in rows]
        if self.tokenizer is None:
            return default_data_collator(rows)
        pad = DataCollatorForTokenClassification(self.tokenizer, label_pad_token_id=IGNORE_INDEX,
                                                 pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt")
        return dict(pad(rows))

    def mask(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """``example`` with masked ``input_ids`` and the ``labels`` of its chosen tokens."""
        ids = list(example["input_ids"])
        special = self.tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
        masked, labels = mask_sample(ids, [bool(s) for s in special], mask_token_id=self.tokenizer.mask_token_id,
                                     vocab_size=len(self.tokenizer), seed=self.seed,
                                     mlm_probability=self.mlm_probability, mask_replace_prob=self.mask_replace_prob,
                                     random_replace_prob=self.random_replace_prob)
        return {**example, "input_ids": masked, "labels": labels}


def _as_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value
