"""Tiny random HF T5-family reference models (t5 v1, t5 v1.1 / FLAN-T5, mt5), built and saved locally (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

VOCAB = 96
KINDS = ("t5", "t5_v1_1", "mt5")


def tiny_hf_config(kind: str, **overrides):
    """A 2+2-layer config of ``kind`` with few buckets and a short max distance, so long and short distances both
    occur in 30-token inputs."""
    common = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
                  dropout_rate=0.0, pad_token_id=0, eos_token_id=1)
    common.update(overrides)
    if kind == "t5":
        return transformers.T5Config(feed_forward_proj="relu", **common)
    if kind == "t5_v1_1":
        return transformers.T5Config(feed_forward_proj="gated-gelu", **common)
    if kind == "mt5":
        return transformers.MT5Config(feed_forward_proj="gated-gelu", **common)
    raise ValueError(kind)


def save_tiny_hf(kind: str, path: Path, head: str = "seq2seq_lm", **overrides) -> Path:
    """Save a seeded tiny HF checkpoint of ``kind`` to ``path``: norms randomised (the default 1s would hide a
    mapping mistake); v1.1 and mt5 with an untied head and ``tie_word_embeddings: false`` in config.json, as
    published FLAN-T5 / mT5 checkpoints have."""
    torch.manual_seed(1234)
    config = tiny_hf_config(kind, **overrides)
    model = _encoder_class(kind)(config) if head == "encoder" else _auto(head).from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        if kind != "t5" and head == "seq2seq_lm":
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    model.save_pretrained(path)
    if kind != "t5":
        config = json.loads((path / "config.json").read_text())
        config["tie_word_embeddings"] = False
        config.pop("scale_decoder_outputs", None)
        (path / "config.json").write_text(json.dumps(config))
    return path


def _auto(head: str):
    return {"seq2seq_lm": transformers.AutoModelForSeq2SeqLM, "base": transformers.AutoModel}[head]


def _encoder_class(kind: str):
    return transformers.MT5EncoderModel if kind == "mt5" else transformers.T5EncoderModel


def load_hf(path: Path, kind: str, head: str = "seq2seq_lm"):
    """transformers' own model of the checkpoint at ``path``."""
    cls = _encoder_class(kind) if head == "encoder" else _auto(head)
    return cls.from_pretrained(path).eval()


def batch(seed: int = 0, rows: int = 3, source: int = 30, target: int = 25):
    """Encoder ids with right and left padding, and labels with -100 padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, source), generator=g)
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1, source - 10:] = 0
    if rows > 2:
        mask[2, :5] = 0
    labels = torch.randint(2, VOCAB, (rows, target), generator=g)
    labels[0, target - 5:] = -100
    return ids, mask, labels
