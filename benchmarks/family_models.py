"""The model and data of each family's training benchmark, built the same way for transformers and for us.

Each :class:`Family` saves a seeded random transformers checkpoint (transformers' own class and default config values,
dropout included: what a user of transformers trains) and makes a list of ready examples (tensors of equal length,
so ``default_data_collator`` stacks them and no tokenizer or padding is measured). Our side loads the same checkpoint
through ``mindformers_py``'s Auto class (its converter), so both trainers start from the same weights.

Shapes are small enough for a 2-core CPU and large enough that matrix products are most of a step in fp32:

========  ==========================================================================  ===========================
family    model (transformers class)                                                   batch (items per step)
========  ==========================================================================  ===========================
gpt       GPT-2, 4 layers x 256, 4 heads, vocabulary 4096 (GPT2LMHeadModel)            8 x 256 tokens
moe       Mixtral, 4 layers x 256, 8 experts of 384, top-2, vocabulary 4096            8 x 256 tokens
qwen3     Qwen3, 4 layers x 256, 4 heads (2 KV), q/k norms, vocabulary 4096            8 x 256 tokens
qwen3_moe Qwen3-MoE, 4 layers x 256, 8 experts of 384, top-2 renormalised, q/k norms   8 x 256 tokens
bert      BERT, 4 layers x 256, 4 heads, vocabulary 30522, 15% masked (BertForMaskedLM) 16 x 128 tokens
t5        t5_tiny's shape: 4+4 layers x 256, vocabulary 8192 (T5ForConditionalGeneration) 16 x (128 source + 32 target)
vit       28 px images, 4 px patches, width 64, 4 layers, 10 classes (ViTForImageClassification) 32 images
========  ==========================================================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import transformers

import mindformers_py as mf


@dataclass(frozen=True)
class Family:
    """How to build one family's benchmark: the transformers model, our Auto class, the data and what an item is."""

    name: str
    hf_class: Callable[[], type]
    """transformers' model class (a function, so transformers' lazy import runs only for the families used)."""
    our_class: Callable[[], type]
    """our Auto class that loads the transformers checkpoint."""
    hf_config: Callable[[], transformers.PretrainedConfig]
    make_data: Callable[[int, int], list[dict[str, torch.Tensor]]]
    """(number of examples, seed) -> examples."""
    batch: int
    unit: str
    """What the throughput counts: ``tokens`` (input tokens; for T5 source + target) or ``images``."""
    items_per_example: int

    def save_checkpoint(self, folder: str, seed: int = 0) -> transformers.PreTrainedModel:
        """Save a seeded random transformers model of this family into ``folder``; returns it."""
        torch.manual_seed(seed)
        model = self.hf_class()(self.hf_config())
        model.save_pretrained(folder)
        return model

    def load(self, side: str, folder: str) -> torch.nn.Module:
        """The model a side trains: transformers' class (``hf*``) or ours (``ours*``) on the saved weights."""
        return (self.our_class() if side.startswith("ours") else self.hf_class()).from_pretrained(folder)


def _token_rows(vocab: int, seq: int) -> Callable[[int, int], list[dict[str, torch.Tensor]]]:
    def make(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
        ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
        return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]
    return make


def masked_rows(vocab: int, seq: int) -> Callable[[int, int], list[dict[str, torch.Tensor]]]:
    """Pre-masked MLM rows: 15% of the positions labelled, 80% of those replaced by [MASK] (id 103)."""
    def make(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1000, vocab, (n, seq), generator=g)
        chosen = torch.rand(n, seq, generator=g) < 0.15
        labels = ids.masked_fill(~chosen, -100)
        masked = ids.masked_fill(chosen & (torch.rand(n, seq, generator=g) < 0.8), 103)
        return [{"input_ids": m, "attention_mask": torch.ones_like(m), "labels": y} for m, y in zip(masked, labels)]
    return make


def _seq2seq_rows(vocab: int, source: int, target: int) -> Callable[[int, int], list[dict[str, torch.Tensor]]]:
    def make(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(2, vocab, (n, source), generator=g)
        tgt = torch.randint(2, vocab, (n, target), generator=g)
        return [{"input_ids": s, "attention_mask": torch.ones_like(s), "labels": t} for s, t in zip(src, tgt)]
    return make


def _images(size: int, classes: int) -> Callable[[int, int], list[dict[str, torch.Tensor]]]:
    def make(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(n, 3, size, size, generator=g)
        labels = torch.randint(0, classes, (n,), generator=g)
        return [{"pixel_values": p, "labels": y} for p, y in zip(pixels, labels)]
    return make


def _t5_config() -> transformers.PretrainedConfig:
    from mindformers_py.models.t5.convert_t5 import config_to_hf

    config = config_to_hf(mf.AutoConfig.from_pretrained("t5_tiny"))
    config.decoder_start_token_id = 0
    return config


FAMILIES: dict[str, Family] = {
    "gpt": Family(
        "gpt", lambda: transformers.GPT2LMHeadModel, lambda: mf.AutoModelForCausalLM,
        lambda: transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=4096),
        _token_rows(4096, 256), batch=8, unit="tokens", items_per_example=256),
    "moe": Family(
        "moe", lambda: transformers.MixtralForCausalLM, lambda: mf.AutoModelForCausalLM,
        lambda: transformers.MixtralConfig(
            hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            num_local_experts=8, num_experts_per_tok=2, vocab_size=4096, max_position_embeddings=256),
        _token_rows(4096, 256), batch=8, unit="tokens", items_per_example=256),
    "qwen3": Family(
        "qwen3", lambda: transformers.Qwen3ForCausalLM, lambda: mf.AutoModelForCausalLM,
        lambda: transformers.Qwen3Config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=4096, max_position_embeddings=256),
        _token_rows(4096, 256), batch=8, unit="tokens", items_per_example=256),
    "qwen3_moe": Family(
        "qwen3_moe", lambda: transformers.Qwen3MoeForCausalLM, lambda: mf.AutoModelForCausalLM,
        lambda: transformers.Qwen3MoeConfig(
            hidden_size=256, intermediate_size=768, moe_intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, vocab_size=4096, max_position_embeddings=256),
        _token_rows(4096, 256), batch=8, unit="tokens", items_per_example=256),
    "deepseek_v3": Family(
        "deepseek_v3", lambda: transformers.DeepseekV3ForCausalLM, lambda: mf.AutoModelForCausalLM,
        lambda: transformers.DeepseekV3Config(
            hidden_size=256, intermediate_size=768, moe_intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, vocab_size=4096, max_position_embeddings=256),
        _token_rows(4096, 256), batch=8, unit="tokens", items_per_example=256),
    "bert": Family(
        "bert", lambda: transformers.BertForMaskedLM, lambda: mf.AutoModelForMaskedLM,
        lambda: transformers.BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        intermediate_size=1024, max_position_embeddings=512),
        masked_rows(30522, 128), batch=16, unit="tokens", items_per_example=128),
    "t5": Family(
        "t5", lambda: transformers.T5ForConditionalGeneration, lambda: mf.AutoModelForSeq2SeqLM, _t5_config,
        _seq2seq_rows(8192, 128, 32), batch=16, unit="tokens", items_per_example=128 + 32),
    "vit": Family(
        "vit", lambda: transformers.ViTForImageClassification, lambda: mf.AutoModelForImageClassification,
        lambda: transformers.ViTConfig(image_size=28, patch_size=4, hidden_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, intermediate_size=128, num_labels=10),
        _images(28, 10), batch=32, unit="images", items_per_example=1),
}
