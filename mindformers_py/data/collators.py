"""Batch collation for causal language modelling, on top of transformers' collators."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, PreTrainedTokenizerBase, \
    default_data_collator

from mindformers_py.errors import MindFormersError
from mindformers_py.layers.loss import IGNORE_INDEX


@dataclass
class DataCollatorForCausalLM:
    """Turn a list of examples into a padded batch of tensors for a causal LM.

    Examples are dicts with ``input_ids`` (a list or a tensor) and optionally ``attention_mask`` and
    ``labels``. The batch holds ``input_ids`` padded with the tokenizer's pad token (on its
    ``padding_side``), ``attention_mask`` and ``labels``:

    * without ``labels`` in the examples, labels are a copy of ``input_ids`` with -100 on padding
      (transformers' ``DataCollatorForLanguageModeling(mlm=False)``); padding is found from the
      attention mask, so a tokenizer whose pad token equals its eos token keeps real eos tokens as
      targets;
    * with ``labels`` (e.g. a prompt already masked with -100), they are kept and padded with -100
      (transformers' ``DataCollatorForSeq2Seq``).

    The model shifts labels itself, so none are shifted here.
    """

    tokenizer: PreTrainedTokenizerBase
    """Tokenizer supplying ``pad_token_id`` and ``padding_side``; it must have a pad token."""
    pad_to_multiple_of: int | None = None
    """Round the padded length up to a multiple of this (e.g. 8 for tensor cores); None pads to the longest."""
    _lm: DataCollatorForLanguageModeling = field(init=False, repr=False)
    _with_labels: DataCollatorForSeq2Seq = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tokenizer.pad_token_id is None:
            raise MindFormersError(
                f"tokenizer {type(self.tokenizer).__name__} has no pad_token; set tokenizer.pad_token "
                "(e.g. to its eos_token) before collating"
            )
        self._lm = DataCollatorForLanguageModeling(
            self.tokenizer, mlm=False, pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt"
        )
        self._with_labels = DataCollatorForSeq2Seq(
            self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of, label_pad_token_id=-100, return_tensors="pt"
        )

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate ``examples`` into a dict of tensors (see the class docstring)."""
        if not examples:
            raise MindFormersError("cannot collate an empty list of examples")
        examples = [{k: _as_list(v) for k, v in ex.items()} for ex in examples]
        if examples[0].get("labels") is not None:
            return dict(self._with_labels(examples))
        batch = dict(self._lm(examples))
        if "attention_mask" in batch:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return batch


def _as_list(value: Any) -> Any:
    # tokenizer.pad and the label padding treat lists uniformly; tensors/arrays take slower, fussier paths.
    return value.tolist() if hasattr(value, "tolist") else value


class StackingCausalLMCollator:
    """Collator for causal-LM examples of equal length without a tokenizer: stacks them (transformers'
    ``default_data_collator``) and adds ``labels`` = ``input_ids`` (-100 where ``attention_mask`` is 0) when the
    examples have none."""

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, Any]:
        lengths = {len(ex["input_ids"]) for ex in examples}
        if len(lengths) > 1:
            raise MindFormersError(
                f"examples of different lengths ({sorted(lengths)[0]} .. {sorted(lengths)[-1]} tokens) need padding; "
                "pass processing_class=<tokenizer with a pad token> or a data_collator to the Trainer"
            )
        batch = default_data_collator(list(examples))
        if "labels" not in batch:
            labels = batch["input_ids"].clone()
            if "attention_mask" in batch:
                labels.masked_fill_(batch["attention_mask"] == 0, IGNORE_INDEX)
            batch["labels"] = labels
        return batch
