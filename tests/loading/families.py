"""One tiny HF checkpoint per family, saved locally, with the transformers class that loads it, ours, and inputs:
shared by the hub-id and loading-context tests."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

import mindformers_py as mf

COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The commit our populated caches name (any 40 hex digits)."""


@dataclass
class Family:
    name: str
    save: Callable[[Path], None]
    hf_auto: Any
    ours: Any
    inputs: Callable[[], dict[str, torch.Tensor]]
    generates: bool


def _ids(vocab: int = 96, length: int = 7) -> torch.Tensor:
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(0))


def _save_gpt(folder: Path) -> None:
    from support.hf_models import tiny_hf_model

    tiny_hf_model("llama", vocab_size=300).save_pretrained(folder)  # room for a byte-level BPE's 258 tokens


def _save_moe(folder: Path) -> None:
    from support.hf_models import tiny_hf_model

    tiny_hf_model("mixtral").save_pretrained(folder)


def _save_bert(folder: Path) -> None:
    from support.bert_models import tiny_bert_model

    tiny_bert_model("bert", "masked_lm").save_pretrained(folder)


def _save_t5(folder: Path) -> None:
    from support.t5_models import save_tiny_hf

    save_tiny_hf("t5_v1_1", folder)


def _save_vit(folder: Path) -> None:
    from support.vit_models import save_hf_vit

    save_hf_vit(folder)


FAMILIES = {
    "gpt": Family("gpt", _save_gpt, transformers.AutoModelForCausalLM, mf.AutoModelForCausalLM,
                  lambda: {"input_ids": _ids()}, True),
    "moe": Family("moe", _save_moe, transformers.AutoModelForCausalLM, mf.AutoModelForCausalLM,
                  lambda: {"input_ids": _ids()}, True),
    "bert": Family("bert", _save_bert, transformers.AutoModelForMaskedLM, mf.AutoModelForMaskedLM,
                   lambda: {"input_ids": _ids(), "attention_mask": torch.ones(2, 7, dtype=torch.long)}, False),
    "t5": Family("t5", _save_t5, transformers.AutoModelForSeq2SeqLM, mf.AutoModelForSeq2SeqLM,
                 lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(length=4)}, True),
    "vit": Family("vit", _save_vit, transformers.AutoModelForImageClassification, mf.AutoModelForImageClassification,
                  lambda: {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))},
                  False),
}


def populate_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put ``folder``'s files in ``cache`` as huggingface_hub lays out a downloaded repository (``models--org--name``
    with ``refs/<ref>`` naming the commit and the files under ``snapshots/<commit>``); returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    return snapshot


def first_output(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]
