"""Task heads and data shared by the gradient-equivalence tests (tests/trainer/test_task_losses.py and the layout
tests of tests/parallel/): one tiny model per task head, N right-padded rows with the head's labels, and the
gradients of a Trainer's first optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import TrainerCallback

import mindformers_py as mf
from mindformers_py.trainer import Trainer, TrainingArguments

VOCAB, SEQ, N = 64, 12, 8
HEADS = ["causal_lm", "single_label", "multi_label", "regression", "token_classification", "question_answering",
         "hf_sequence_classifier", "image_classification", "bert_masked_lm", "bert_single_label",
         "bert_token_classification", "bert_question_answering", "moe_causal_lm", "seq2seq_lm"]
# Heads of the layout tests only (not in HEADS): causal LMs on packed rows (positions restarting at each document,
# no attention mask), with Mistral's sliding window, Qwen3 (per-head q/k norms, a full then a sliding layer) and
# Qwen3-MoE (q/k norms, renormalised top-2, no shared expert).
EXTRA_HEADS = ["packed_causal_lm", "window_causal_lm", "qwen3_causal_lm", "qwen3_moe_causal_lm"]
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "aux_loss_scope": "sequence",
       "aux_loss_factor": 0.1, "z_loss_factor": 0.01, "moe_intermediate_size": 16}
TARGET = 7  # label tokens of the encoder-decoder's rows


def _config(**extra) -> mf.GPTConfig:
    return mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, **extra)


def _bert_config(**extra) -> mf.BertConfig:
    return mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                         **extra)


def make_model(head: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if head.startswith("bert_"):
        return {"bert_masked_lm": mf.BertForMaskedLM, "bert_single_label": mf.BertForSequenceClassification,
                "bert_token_classification": mf.BertForTokenClassification,
                "bert_question_answering": mf.BertForQuestionAnswering}[head](_bert_config(num_labels=3 if head == "bert_single_label" else 5))
    if head in ("causal_lm", "packed_causal_lm"):
        return mf.GPTForCausalLM(_config())
    if head == "window_causal_lm":
        return mf.GPTForCausalLM(_config(sliding_window=3))
    if head == "moe_causal_lm":
        return mf.GPTForCausalLM(_config(moe_config=MOE, output_router_logits=True))
    if head == "qwen3_causal_lm":
        return mf.GPTForCausalLM(_config(qk_norm=True, sliding_window=3, layer_types=["full_attention",
                                                                                    "sliding_attention"]))
    if head == "qwen3_moe_causal_lm":
        return mf.GPTForCausalLM(_config(qk_norm=True, output_router_logits=True,
                                         moe_config={**MOE, "norm_topk_prob": True, "z_loss_factor": 0.0}))
    if head == "single_label":
        return mf.GPTForSequenceClassification(_config(num_labels=3))
    if head == "multi_label":
        return mf.GPTForSequenceClassification(_config(num_labels=3, problem_type="multi_label_classification"))
    if head == "regression":
        return mf.GPTForSequenceClassification(_config(num_labels=1))
    if head == "token_classification":
        return mf.GPTForTokenClassification(_config(num_labels=5))
    if head == "question_answering":
        return mf.GPTForQuestionAnswering(_config())
    if head == "image_classification":  # 12x12 images in 4x4 patches: 10 tokens, which tp2 splits evenly
        return mf.ViTForImageClassification(mf.ViTConfig(image_size=12, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, intermediate_size=64, num_labels=3))
    if head == "seq2seq_lm":
        return mf.T5ForConditionalGeneration(mf.T5Config(
            vocab_size=VOCAB, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=1, num_decoder_layers=1,
            num_attention_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False))  # T5 v1.1 (the tied v1: test_t5_parallel.py)
    # transformers' own classifier, whose loss is a batch mean whatever num_items_in_batch says
    return transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, num_labels=3, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def make_data(head: str) -> list[dict[str, torch.Tensor]]:
    """N right-padded rows of different lengths (so items per micro-batch differ) with the head's labels."""
    g = torch.Generator().manual_seed(7)
    lengths = [12, 5, 9, 3, 12, 7, 4, 10]
    rows = []
    if head == "image_classification":  # one ignored label, so micro-batches hold different numbers of images
        return [{"pixel_values": torch.randn(3, 12, 12, generator=g),
                 "labels": torch.tensor(-100 if i == 2 else i % 3)} for i in range(N)]
    if head == "packed_causal_lm":  # documents of these lengths packed into rows, as DataCollatorWithFlattening does
        for i in range(N):
            ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
            docs = [lengths[i], SEQ - lengths[i]] if lengths[i] < SEQ else [SEQ]
            positions = torch.cat([torch.arange(n) for n in docs if n])
            labels = ids.masked_fill(positions == 0, -100)
            rows.append({"input_ids": ids, "position_ids": positions, "labels": labels})
        return rows
    for i, length in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        ids[length:] = 0
        mask = (torch.arange(SEQ) < length).long()
        row = {"input_ids": ids, "attention_mask": mask}
        kind = "causal_lm" if head in ("moe_causal_lm", "window_causal_lm", "qwen3_causal_lm", "qwen3_moe_causal_lm") \
            else head
        if head.startswith("bert_"):  # sentence pairs: the second half of each row is segment B
            row["token_type_ids"] = ((torch.arange(SEQ) >= length // 2) & (mask == 1)).long()
            kind = head.removeprefix("bert_").replace("masked_lm", "mlm")
        if kind == "mlm":  # the ids of ~30% of the real tokens, as a masking collator leaves them
            row["labels"] = ids.masked_fill((torch.rand(SEQ, generator=g) > 0.3) | (mask == 0), -100)
            row["labels"][0] = ids[0]  # every row holds at least one label
        elif kind == "causal_lm":
            row["labels"] = ids.masked_fill(mask == 0, -100)
        elif kind in ("single_label", "hf_sequence_classifier"):
            row["labels"] = torch.tensor(-100 if i == 2 else int(torch.randint(0, 3, (), generator=g)))
        elif kind == "multi_label":
            row["labels"] = torch.randint(0, 2, (3,), generator=g).float()
        elif kind == "regression":
            row["labels"] = torch.randn((), generator=g)
        elif kind == "seq2seq_lm":  # targets of different lengths, padded with -100
            row["labels"] = torch.randint(1, VOCAB, (TARGET,), generator=g)
            row["labels"][1 + i % TARGET:] = -100
        elif kind == "token_classification":
            row["labels"] = torch.randint(0, 5, (SEQ,), generator=g).masked_fill(mask == 0, -100)
        else:
            row["start_positions"] = torch.randint(0, length, (), generator=g)
            row["end_positions"] = torch.randint(0, length, (), generator=g)
        rows.append(row)
    return rows


class FirstStepGradients(TrainerCallback):
    """The gradients the first optimizer step applies (clipping is off)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def first_step(head: str, batch: int, accumulation: int, folder: str, parallel=None, trainer_class: type = Trainer,
               bf16: bool = False, **trainer_kwargs) -> tuple[dict, float]:
    """Gradients and logged loss of the first step over the same N samples (``trainer_class`` built with
    ``trainer_kwargs`` besides the usual arguments, e.g. a ``compute_loss_func``), in fp32 or under bf16 autocast."""
    clock = FirstStepGradients()
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                             max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, plot_loss_curve=False, use_cpu=True, bf16=bf16,
                             parallel_config=parallel or mf.ParallelConfig())
    trainer = trainer_class(model=make_model(head), args=args, train_dataset=make_data(head), callbacks=[clock],
                            **trainer_kwargs)
    return train_first_step(trainer, clock)


def train_first_step(trainer, clock: FirstStepGradients) -> tuple[dict, float]:
    """Train ``trainer`` (one step, ``clock`` among its callbacks); the step's gradients and logged loss."""
    trainer.train()
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    trainer.engine.teardown()
    return clock.grads, loss


def full_gradients(grads: dict) -> dict:
    """Gradients by the checkpoint's names, whole: recompute wraps layers (a name part the checkpoints drop) and
    tensor parallelism gives DTensor gradients."""
    return {k.replace("_checkpoint_wrapped_module.", ""): v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in grads.items()}


def assert_same(grads, loss, ref_grads, ref_loss):
    assert math.isclose(loss, ref_loss, rel_tol=1e-5), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)


def assert_bf16_close(loss: float, ref_loss: float, fp32_loss: float) -> None:
    """A layout's first-step loss under bf16 autocast against stand-alone's under bf16 autocast (within
    :data:`tolerances.BF16_LAYOUT`); ``fp32_loss``, stand-alone's in fp32, shows that autocast was on there."""
    from support.tolerances import BF16_LAYOUT

    assert math.isfinite(loss) and loss == pytest.approx(ref_loss, **BF16_LAYOUT), (loss, ref_loss)
    assert ref_loss != fp32_loss  # the bf16 reference really ran in bf16
