"""The output head fused with its loss (``TrainingArguments.fused_loss``).

The kernel (:func:`linear_cross_entropy`) must give ``F.linear`` + ``F.cross_entropy``'s loss and the gradients of
hidden states, weight and bias, and make no weight-sized gradient for a frozen head (a LoRA run's: at a 152k
vocabulary that buffer is 1.2 GB in fp32), nor any gradient without grad mode (evaluation). A GPT causal LM inside ``loss_without_logits`` must give its own loss and
gradients without making logits, also for pre-shifted targets and an MoE's router loss, and keep its own loss where
the head cannot be read whole (a peft adapter on it, multi-token prediction).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindformers_py as mf
from mindformers_py.adapters import apply_peft
from mindformers_py.layers.loss import IGNORE_INDEX, linear_cross_entropy
from mindformers_py.layers.loss.fused_head import loss_without_logits

VOCAB, SEQ = 96, 12


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 17])
def test_kernel_gives_the_plain_loss_and_gradients(bias, num_items):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, SEQ, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    labels[0, :4] = IGNORE_INDEX
    fused = linear_cross_entropy(hidden, weight, labels, num_items, b)
    grads = torch.autograd.grad(fused * 3, [t for t in (hidden, weight, b) if t is not None])
    logits = F.linear(hidden, weight, b)[:, :-1].flatten(0, 1)
    plain = F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                            reduction="mean" if num_items is None else "sum")
    plain = plain if num_items is None else plain / num_items
    expected = torch.autograd.grad(plain * 3, [t for t in (hidden, weight, b) if t is not None])
    torch.testing.assert_close(fused, plain)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_kernel_makes_no_weight_gradient_for_a_frozen_head():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, SEQ, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g)  # frozen
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, labels)
    assert saved == [hidden.shape.__class__((2 * SEQ, 16))]  # the hidden states' gradient only
    (grad,) = torch.autograd.grad(loss, [hidden])
    expected = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight)[:, :-1].flatten(0, 1),
                                                   labels[:, 1:].flatten()), [hidden])[0]
    torch.testing.assert_close(grad, expected)


def test_kernel_makes_no_gradient_without_grad_mode_even_for_a_trained_head():
    """Evaluation (no grad) of a trained head: the loss only, one product per chunk, none of the gradients' two (the
    weight's would be a (vocabulary x hidden) fp32 buffer: an evaluation under ep2 held 2.9 GiB a rank more)."""
    from torch.profiler import profile

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, SEQ, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    with torch.no_grad(), profile() as prof:
        loss = linear_cross_entropy(hidden, weight, labels)
    products = [e.key for e in prof.key_averages() for _ in range(e.count) if e.key in ("aten::mm", "aten::addmm_",
                                                                                         "aten::addmm")]
    assert products == ["aten::mm"]  # the logits of the one chunk
    expected = F.cross_entropy(F.linear(hidden, weight)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)


def tiny_gpt(**fields) -> mf.GPTForCausalLM:
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                          max_position_embeddings=SEQ, **fields)
    return mf.GPTForCausalLM(config).train()


MOE = {"output_router_logits": True, "moe_config": {"expert_num": 4, "num_experts_chosen": 2,
                                                    "routing_policy": "dropless", "moe_intermediate_size": 16}}


def _inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :5] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, inputs, fused: bool):
    model.zero_grad(set_to_none=True)
    if fused:
        with loss_without_logits(model) as heads:
            output = model(**inputs, num_items_in_batch=40)
        assert heads and all(h.fused_loss_taken for h in heads)
        assert output.logits is None
    else:
        output = model(**inputs, num_items_in_batch=40)
        assert output.logits is not None
    output.loss.backward()
    return output.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["dense", "moe", "pre_shifted", "lora"])
def test_model_gives_its_own_loss_and_gradients_without_logits(kind):
    model = tiny_gpt(**(MOE if kind == "moe" else {}))
    if kind == "lora":
        model = apply_peft(model, {"type": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"],
                                   "init_lora_weights": False}, task="causal_lm")
    inputs = _inputs()
    if kind == "pre_shifted":  # what sequence / context parallelism sends: targets aligned with the positions
        shifted = torch.cat([inputs["labels"][:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
        inputs = {**inputs, "shift_labels": shifted}
    plain_loss, plain = _loss_and_grads(model, inputs, fused=False)
    fused_loss, fused = _loss_and_grads(model, inputs, fused=True)
    torch.testing.assert_close(fused_loss, plain_loss)
    assert set(fused) == set(plain) and plain
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert all(not m.fuse_loss_with_head for m in model.modules() if hasattr(m, "fuse_loss_with_head"))


def test_model_keeps_its_own_loss_where_the_head_is_adapted_or_predicts_ahead():
    adapted = apply_peft(tiny_gpt(), {"type": "lora", "r": 4, "target_modules": ["lm_head"]}, task="causal_lm")
    with loss_without_logits(adapted) as heads:
        output = adapted(**_inputs())
    assert output.logits is not None and not heads[0].fused_loss_taken
    ahead = tiny_gpt(use_mtp=True, num_nextn_predict_layers=1)
    with loss_without_logits(ahead) as heads:
        output = ahead(**_inputs())
    assert output.logits is not None and not heads[0].fused_loss_taken and output.mtp_loss is not None
