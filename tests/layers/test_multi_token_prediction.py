"""Multi-token prediction (DeepSeek-V3 section 2.2) against its equations written out here: for each depth k the
truncated sequences h'^k_{1:T-k} of eq. 21 through the block (eq. 22), the shared head (eq. 23) and the per-depth
cross-entropy on the labels k + 1 ahead, weighted by lambda / D (eqs. 24-25): the loss and the gradients of every
weight (MTP module, block, main embedding and head) agree; ignored labels count nowhere; micro-batch shares add up
with ``num_items_in_batch``; checkpoint names map both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mindformers_py.layers.block import TransformerBlock
from mindformers_py.layers.moe.config import MoEConfig
from mindformers_py.layers.moe.layer import MoE
from mindformers_py.layers.multi_token_prediction import (MultiTokenPrediction, checkpoint_name, module_name,
                                                          mtp_loss, mtp_targets)
from mindformers_py.models.gpt import GPTConfig

H, V, B, T, D = 16, 32, 2, 9, 2
LAMBDA = 0.3


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _setup(seed: int = 0):
    """A main model's embedding and head, D MTP modules whose blocks are causal transformer blocks with a
    DeepSeek-V3 MoE, random weights (norm scales too), hidden states, tokens and labels with ignored positions."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0)
    moe = MoEConfig(expert_num=4, num_experts_chosen=2, routing_policy="dropless", router_type="deepseek_v3",
                    n_group=2, topk_group=1, moe_intermediate_size=8, shared_expert_num=1)
    mtp = MultiTokenPrediction(H, D, lambda k: TransformerBlock(config, 1 + k, mlp=MoE(H, 32, moe)))
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    with torch.no_grad():
        for p in [*mtp.parameters(), *embed.parameters(), *head.parameters()]:
            p.normal_(0.0, 0.3)
        for layer in mtp.layers:
            for norm in (layer.enorm, layer.hnorm, layer.shared_head.norm):
                norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(B, T, H, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored target inside the row
    labels[1, :3] = -100  # a left-padded row
    return mtp, embed, head, hidden, ids, labels


def _paper_loss(mtp, embed, head, hidden, ids, labels):
    """Eqs. 21-25 position by position: depth k sees t_{i+k} for i < T - k only, predicts t_{i+k+1}."""
    total = 0.0
    h_prev = hidden
    for k, layer in enumerate(mtp.layers, start=1):
        n = T - k  # h'^k_{1:T-k}
        emb = embed(ids[:, k:k + n])
        h_in = torch.cat([_rms(emb, layer.enorm.weight), _rms(h_prev[:, :n], layer.hnorm.weight)], dim=-1)
        h_in = h_in @ layer.eh_proj.weight.t()
        h_k = layer.block(h_in)[0]  # the block is the caller's: the same module, on the truncated sequence
        logits = _rms(h_k, layer.shared_head.norm.weight) @ head.weight.t()
        log_probs = torch.log_softmax(logits, dim=-1)
        terms = []
        for b in range(B):
            for i in range(n - 1):  # position i predicts t_{i+k+1}, which exists for i + k + 1 < T
                target = int(labels[b, i + k + 1])
                if target != -100:
                    terms.append(-log_probs[b, i, target])
        total = total + torch.stack(terms).mean()
        h_prev = h_k
    return LAMBDA / D * total


def test_loss_and_gradients_equal_the_papers_equations():
    mtp, embed, head, hidden, ids, labels = _setup()
    params = [hidden, *mtp.parameters(), *embed.parameters(), *head.parameters()]
    logits, extras = mtp(hidden, ids, embed, head)
    assert len(logits) == D and logits[0].shape == (B, T, V)
    assert all(stats.shape[0] == B for stats in extras)  # each block's MoE statistics come back
    ours = mtp_loss(logits, labels, LAMBDA)
    grads = torch.autograd.grad(ours, params)
    reference = _paper_loss(mtp, embed, head, hidden, ids, labels)
    expected = torch.autograd.grad(reference, params)
    assert abs(ours.item() - reference.item()) <= 1e-6
    for p, g, e in zip(params, grads, expected):
        assert (g - e).abs().max().item() <= 1e-5, p.shape
    assert mtp.layers[0].eh_proj.weight.grad is None  # autograd.grad, nothing accumulated


def test_ignored_labels_count_nowhere():
    """Changing the logits where the target is ignored (or absent) changes nothing, elsewhere it does."""
    mtp, embed, head, hidden, ids, labels = _setup()
    with torch.no_grad():
        logits, _ = mtp(hidden, ids, embed, head)
    targets = mtp_targets(labels, 1)
    assert targets[0, 3].item() == -100 and targets[1, :1].eq(-100).all() and targets[:, -2:].eq(-100).all()
    assert torch.equal(targets[0, :3], labels[0, 2:5])
    base = mtp_loss(logits, labels, LAMBDA)
    noisy = [depth.clone() for depth in logits]
    noisy[0][0, 3, :5] += 5.0  # depth 1, position 3 predicts labels[0, 5]: ignored
    noisy[1][:, -3:, :5] += 5.0  # depth 2's last 3 positions have nothing to predict
    assert mtp_loss(noisy, labels, LAMBDA).item() == pytest.approx(base.item(), abs=1e-7)
    noisy[0][0, 2, :5] += 5.0  # position 2 predicts labels[0, 4]: counted
    assert mtp_loss(noisy, labels, LAMBDA).item() != pytest.approx(base.item(), abs=1e-4)
    # another ignore_index: the same positions marked with it, and the targets past the end filled with it
    other = labels.masked_fill(labels == -100, -1)
    assert mtp_loss(logits, other, LAMBDA, ignore_index=-1).item() == pytest.approx(base.item(), abs=1e-7)
    assert mtp_targets(other, 2, ignore_index=-1)[:, -3:].eq(-1).all()


def test_micro_batch_shares_add_up_with_num_items_in_batch():
    mtp, embed, head, hidden, ids, labels = _setup()
    with torch.no_grad():
        logits, _ = mtp(hidden, ids, embed, head)
    items = int((labels != -100).sum())
    whole = mtp_loss(logits, labels, LAMBDA, items)
    parts = sum(mtp_loss([depth[rows] for depth in logits], labels[rows], LAMBDA, items) for rows in ([0], [1]))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_checkpoint_names_map_both_ways():
    mtp = _setup()[0]
    for name, _ in mtp.layers[0].named_parameters():
        assert module_name(checkpoint_name(name)) == name
    assert checkpoint_name("block.self_attn.q_proj.weight") == "self_attn.q_proj.weight"
    assert checkpoint_name("shared_head.norm.weight") == "shared_head.norm.weight"
    assert module_name("mlp.gate.e_score_correction_bias") == "block.mlp.gate.e_score_correction_bias"
    assert module_name("shared_head.head.weight") is None and module_name("embed_tokens.weight") is None
    names = {name for name, _ in mtp.layers[0].named_parameters()}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"} <= names
    assert mtp.layers[0].eh_proj.weight.shape == (H, 2 * H)
