"""DeepSeek-V3's router (``router_type="deepseek_v3"``): the MoE layer with it against transformers' own
``DeepseekV3MoE`` on the same weights (a selection bias that changes the choices, group limits, scaling), its
statistics, its one-line config errors, and the auxiliary-loss-free bias update on known loads."""

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from mindformers_py.errors import ConfigError
from mindformers_py.layers.moe.config import MoEConfig
from mindformers_py.layers.moe.layer import MoE, router_losses, stat_columns
from mindformers_py.layers.moe.sigmoid_router import GroupLimitedSigmoidRouter

H, I, E = 16, 8, 8


def _pair(n_group: int = 4, topk_group: int = 2, k: int = 3, norm: bool = True, scale: float = 2.5):
    """transformers' DeepseekV3MoE with random weights and a bias, and our MoE layer holding the same weights."""
    torch.manual_seed(0)
    hf_config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                                 n_group=n_group, topk_group=topk_group, n_shared_experts=1, norm_topk_prob=norm,
                                 routed_scaling_factor=scale, hidden_act="silu")
    hf = DeepseekV3MoE(hf_config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0.0, 0.3)
    moe = MoE(H, 4 * I, MoEConfig(expert_num=E, num_experts_chosen=k, moe_intermediate_size=I, shared_expert_num=1,
                                  routing_policy="dropless", router_type="deepseek_v3", n_group=n_group,
                                  topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale))
    with torch.no_grad():
        moe.gate.weight.copy_(hf.gate.weight)
        moe.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        moe.experts.gate_proj.copy_(gate)
        moe.experts.up_proj.copy_(up)
        moe.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_expert, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return hf, moe


@pytest.mark.parametrize("groups", [
    {"n_group": 4, "topk_group": 2, "k": 3},  # group-limited: 2 of 4 groups of 2 experts
    {"n_group": 1, "topk_group": 1, "k": 2, "norm": False, "scale": 1.0},  # no groups, raw scores
    {"n_group": 2, "topk_group": 2, "k": 4},  # every group allowed
])
def test_moe_equals_transformers_deepseek_v3_moe(groups):
    hf, moe = _pair(**groups)
    x = torch.randn(3, 7, H)
    with torch.no_grad():
        expected = hf(x)
        out, stats = moe(x)
        _, hf_weights, hf_chosen = hf.gate(x)
        probs, weights, chosen = moe.gate.select(moe.gate(x))
    assert (out - expected).abs().max().item() <= 1e-5
    # the same experts with the same weights (transformers returns them unsorted)
    order, hf_order = chosen.sort(-1), hf_chosen.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.allclose(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices), atol=1e-6)
    # probs: each token's sigmoid scores normalised over the experts
    scores = torch.sigmoid(x.reshape(-1, H) @ hf.gate.weight.t())
    assert torch.allclose(probs, scores / scores.sum(-1, keepdim=True), atol=1e-6)
    cols = stat_columns(E)
    assert stats[:, cols["counts"]].sum().item() == 3 * 7 * groups["k"]
    assert torch.allclose(stats[:, cols["probs"]].sum(-1), torch.full((3,), 7.0))
    lse = torch.logsumexp(x.reshape(3, 7, H) @ hf.gate.weight.t(), -1)
    assert torch.allclose(stats[:, cols["z"]], lse.square().sum(-1), rtol=1e-5)


def test_bias_changes_the_choice_but_not_the_weights():
    """A large bias on expert 5 puts it among every token's choices, weighted by its unbiased score; transformers
    agrees."""
    hf, moe = _pair(n_group=1, topk_group=1, k=2)
    with torch.no_grad():
        for module in (hf.gate, moe.gate):
            module.e_score_correction_bias.zero_()
            module.e_score_correction_bias[5] = 10.0
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        probs, weights, chosen = moe.gate.select(moe.gate(x))
        assert (chosen == 5).any(-1).all()
        scores = torch.sigmoid(x.reshape(-1, H) @ moe.gate.weight.t())
        raw = scores.gather(1, chosen)
        assert torch.allclose(weights, 2.5 * raw / raw.sum(-1, keepdim=True), atol=1e-6)
        assert (moe(x)[0] - hf(x)).abs().max().item() <= 1e-5


def test_group_limit_keeps_tokens_in_their_best_groups():
    """Expert 0 scores highest but sits in the group whose two best sum lowest: with one group allowed it is
    never chosen."""
    router = GroupLimitedSigmoidRouter(H, 4, top_k=1, n_group=2, topk_group=1)
    logits = torch.tensor([[3.0, -5.0, 2.0, 2.0]])  # group 0: 3 + -5, group 1: 2 + 2
    _, _, chosen = router.select(logits)
    assert chosen.item() in (2, 3)
    router.topk_group = 2
    assert router.select(logits)[2].item() == 0


def test_bias_stays_float32_when_the_model_is_cast():
    moe = _pair()[1].to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.bfloat16
    assert "gate.e_score_correction_bias" in moe.state_dict() and "gate.expert_load" not in moe.state_dict()


@pytest.mark.parametrize("fields, fragments", [
    ({"n_group": 3}, ["n_group=3", "expert_num=8", "divisor"]),
    ({"n_group": 2, "topk_group": 3}, ["topk_group=3", "n_group=2"]),
    ({"n_group": 4, "topk_group": 1, "num_experts_chosen": 3}, ["num_experts_chosen=3", "topk_group=1", "2"]),
    ({"n_group": 0}, ["n_group=0"]),
    ({"routed_scaling_factor": 0}, ["routed_scaling_factor=0"]),
    ({"bias_update_rate": -1}, ["bias_update_rate=-1"]),
    ({"router_type": "softmax_topk", "n_group": 2}, ["n_group=2", "router_type='softmax_topk'", "deepseek_v3"]),
    ({"router_type": "softmax_topk", "bias_update_rate": 0.001}, ["bias_update_rate=0.001", "deepseek_v3"]),
])
def test_group_config_errors_name_the_field(fields, fragments):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**{"expert_num": 8, "num_experts_chosen": 2, "router_type": "deepseek_v3", **fields}).validate()
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_loads_are_counted_in_training_only_and_without_padding():
    moe = _pair(n_group=1, topk_group=1, k=2)[1]
    moe.gate.bias_update_rate = 0.001
    x = torch.randn(2, 5, H)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    moe.eval()
    moe(x, mask)
    assert moe.gate.expert_load.sum() == 0
    moe.train()
    moe(x, mask)
    _, _, chosen = moe.gate.select(moe.gate(x))
    expected = torch.bincount(chosen.view(2, 5, 2)[mask.bool()].reshape(-1), minlength=E)
    assert torch.equal(moe.gate.expert_load, expected)
    assert moe.gate.expert_load.sum() == 8 * 2


def test_update_rule_on_known_loads():
    """bias += rate * sign(mean - load), per expert, in float32; the counts start again."""
    router = GroupLimitedSigmoidRouter(H, 4, top_k=1, bias_update_rate=0.25)
    router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.5, -0.5, 1.0]))
    router.expert_load.fill_(7)
    router.update_bias(torch.tensor([10, 2, 4, 4]))  # mean 5
    assert router.e_score_correction_bias.tolist() == [-0.25, 0.75, -0.25, 1.25]
    assert router.expert_load.sum() == 0
    router.update_bias(torch.tensor([3, 3, 3, 3]))  # balanced: no move
    assert router.e_score_correction_bias.tolist() == [-0.25, 0.75, -0.25, 1.25]
    assert router.e_score_correction_bias.dtype == torch.float32


def test_sequence_balance_loss_is_the_papers_for_the_sigmoid_router():
    """DeepSeek-V3 paper eqs. 17-20, written out: per sequence of T tokens, f_i = E / (K T) · #tokens choosing i,
    s'_{i,t} = s_{i,t} / Σ_j s_{j,t}, P_i = (1/T) Σ_t s'_{i,t}, L = Σ_i f_i P_i; averaged over sequences (and here
    two MoE layers). The choices are transformers' router's; padding tokens count in neither f nor P."""
    hf, moe = _pair(n_group=4, topk_group=2, k=3)
    layers = [(torch.randn(3, 6, H), None), (torch.randn(3, 6, H), torch.tensor([[1] * 6, [0, 0] + [1] * 4, [1] * 6]))]
    stats, expected = [], torch.zeros(3)
    for x, mask in layers:
        _, s = moe(x, mask)
        stats.append(s)
        with torch.no_grad():
            _, _, chosen = hf.gate(x)
        scores = torch.sigmoid(x.reshape(-1, H) @ hf.gate.weight.t()).view(3, 6, E)
        chosen = chosen.view(3, 6, 3)
        for b in range(3):
            keep = torch.ones(6, dtype=torch.bool) if mask is None else mask[b].bool()
            t_b = int(keep.sum())
            f = torch.zeros(E)
            for t in range(6):
                if keep[t]:
                    for i in chosen[b, t]:
                        f[i] += E / (3 * t_b)
            s_norm = scores[b][keep] / scores[b][keep].sum(-1, keepdim=True)
            expected[b] += (f * s_norm.mean(0)).sum() / len(layers)
    aux, _ = router_losses(torch.stack(stats, dim=1), E, "sequence")
    assert abs(aux.item() - expected.mean().item()) <= 1e-6
    # balanced routing gives 1 (the paper's normalisation): all experts chosen equally, uniform scores
    balanced = torch.zeros(1, 1, 2 * E + 3)
    cols = stat_columns(E)
    balanced[0, 0, cols["counts"]], balanced[0, 0, cols["probs"]], balanced[0, 0, cols["tokens"]] = 3.0, 1.0, 8.0
    assert router_losses(balanced, E, "sequence")[0].item() == pytest.approx(1.0)
