"""The MoE layer on its own: routing against a token-by-token reference, Switch capacity and token dropping, shared
experts, router dtype, the load-balancing loss against transformers', sequence-wise shares that add up over any
split of a batch, z-loss, and the config's one-line errors."""

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.layers.moe.layer import MoE, router_losses, stat_columns
from mindformers_py.layers.moe.config import MoEConfig

H, I, E = 16, 24, 4


def make_moe(**fields) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, I, MoEConfig(**{"expert_num": E, "num_experts_chosen": 2, **fields}), act="silu", gated=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def reference(moe: MoE, x: torch.Tensor, drop: set[tuple[int, int]] = frozenset()) -> torch.Tensor:
    """Token by token, choice by choice: what the batched dispatch must equal. ``drop``: (token, choice) skipped."""
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat @ moe.gate.weight.t(), -1)
    weights, chosen = probs.topk(moe.top_k, -1)
    if moe.gate.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for c in range(moe.top_k):
            if (t, c) in drop:
                continue
            e = int(chosen[t, c])
            gate, up = moe.experts.gate_proj[e] @ flat[t], moe.experts.up_proj[e] @ flat[t]
            out[t] += weights[t, c] * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    if moe.shared_expert is not None:
        shared = moe.shared_expert(flat)
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(moe.shared_expert_gate(flat)) * shared
        out = out + shared
    return out.view_as(x)


@pytest.mark.parametrize("fields", [
    {"routing_policy": "dropless"},
    {"routing_policy": "dropless", "norm_topk_prob": False},
    {"routing_policy": "dropless", "shared_expert_num": 2, "use_shared_expert_gating": True},
    {"routing_policy": "topk", "capacity_factor": 4.0},  # capacity of every assignment: nothing dropped
])
def test_dispatch_equals_token_by_token_reference(fields):
    moe = make_moe(**fields)
    x = torch.randn(3, 5, H)
    out, stats = moe(x)
    assert (out - reference(moe, x)).abs().max().item() <= 1e-5
    assert stats[:, stat_columns(E)["dropped"]].sum() == 0


def test_capacity_drops_later_tokens_and_second_choices_first():
    """Every token prefers expert 0 then expert 1: with capacity ceil(1.0 * 8 * 2 / 4) = 4 expert 0 serves tokens
    0-3 only. Expert 1 gets the second choices of all 8 tokens, of which first-come tokens 0-3 fit."""
    moe = make_moe(routing_policy="topk", capacity_factor=1.0)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 2.0, 1.0
    x = torch.randn(1, 8, H).abs() + 0.1  # positive feature 0: logits order expert 0 > 1 > 2 = 3
    assert moe.capacity(8) == 4
    out, stats = moe(x)
    dropped = {(t, c) for t in range(4, 8) for c in (0, 1)}
    assert (out - reference(moe, x, dropped)).abs().max().item() <= 1e-5
    assert stats[0, stat_columns(E)["dropped"]].item() == 8
    assert out[0, 4:].abs().max().item() == 0  # tokens over capacity pass only through the residual


def test_first_choices_claim_slots_before_second_choices():
    """Expert 1 is the first choice of tokens 4-7 and the second choice of tokens 0-3: with room for 4 it takes the
    first choices, even though the second choices belong to earlier tokens."""
    moe = make_moe(routing_policy="topk", capacity_factor=1.0)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 2.0, 1.0  # feature 0 > 0: expert 0 then 1
        moe.gate.weight[1, 1], moe.gate.weight[2, 1] = 2.0, 1.0  # feature 1 > 0: expert 1 then 2
    x = torch.zeros(1, 8, H)
    x[0, :4, 0] = 1.0
    x[0, 4:, 1] = 1.0
    out, _ = moe(x)
    assert (out - reference(moe, x, {(t, 1) for t in range(4)})).abs().max().item() <= 1e-5


def test_router_runs_in_float32_under_bf16_autocast():
    moe = make_moe(routing_policy="dropless")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.gate(torch.randn(4, H)).dtype == torch.float32
    moe.gate.dense_type = "auto"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.gate(torch.randn(4, H)).dtype == torch.bfloat16


def _layers_stats(moe: MoE, batch: torch.Tensor, mask: torch.Tensor | None, layers: int = 3):
    """Router statistics of ``layers`` MoE layers (the same module on shifted inputs) and their logits."""
    stats, logits = [], []
    for layer in range(layers):
        x = batch + layer
        _, s = moe(x, mask)
        stats.append(s)
        logits.append(moe.gate(x))
    return torch.stack(stats, dim=1), tuple(logits)


def test_batch_aux_loss_is_transformers_load_balancing_loss():
    moe = make_moe(routing_policy="dropless")
    x = torch.randn(3, 7, H)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0
    for m in (None, mask):
        stats, logits = _layers_stats(moe, x, m)
        aux, _ = router_losses(stats, E, "batch")
        expected = load_balancing_loss_func(logits, E, 2, m)
        assert abs(aux.item() - expected.item()) <= 1e-5


def test_sequence_aux_loss_is_per_layer_and_sequence_and_z_loss():
    """DeepSeek-V3's sequence-wise balance: transformers' formula for one layer and one sequence over k (the paper's
    f_i = E / (k T) count_i; transformers' share of choices has no 1/k), averaged."""
    moe = make_moe(routing_policy="dropless")
    x = torch.randn(4, 6, H)
    stats, logits = _layers_stats(moe, x, None)
    aux, z = router_losses(stats, E, "sequence")
    per_row_layer = [load_balancing_loss_func((l.view(4, 6, E)[b],), E, 2).item() / 2 for b in range(4) for l in logits]
    assert abs(aux.item() - sum(per_row_layer) / len(per_row_layer)) <= 1e-5
    lse = torch.stack([torch.logsumexp(l, -1) for l in logits])
    assert abs(z.item() - lse.square().mean().item()) <= 1e-5


def test_sequence_scope_sees_imbalance_hidden_across_layers():
    """Two layers of 8 tokens, each sending every choice and all probability to one expert, a different one each:
    transformers' cross-layer formula adds the layers up and sees two experts sharing the load (E * 2 * 1/4 = 2),
    the per-layer loss sees each layer's collapse (E * 1 = 4)."""
    stats = torch.zeros(1, 2, 2 * E + 3)
    cols = stat_columns(E)
    for layer, expert in ((0, 0), (1, 1)):
        stats[0, layer, cols["counts"].start + expert] = 8.0
        stats[0, layer, cols["probs"].start + expert] = 8.0
        stats[0, layer, cols["tokens"]] = 8.0
    assert router_losses(stats, E, "batch")[0].item() == pytest.approx(2.0)
    assert router_losses(stats, E, "sequence")[0].item() == pytest.approx(4.0)


def test_sequence_shares_add_up_over_any_split():
    """With each row's loss items and the step's total, the shares of micro-batches (and ranks) sum to the whole
    batch's value, for the loss and its gradient: why the sequence scope is layout-invariant."""
    moe = make_moe(routing_policy="dropless")
    x = torch.randn(6, 5, H)
    items = torch.tensor([4, 4, 2, 4, 3, 4])
    stats, _ = _layers_stats(moe, x, None)
    whole = sum(router_losses(stats, E, "sequence", items, int(items.sum())))
    whole.backward()
    grad_whole = moe.gate.weight.grad.clone()
    moe.gate.weight.grad = None
    parts = 0
    for rows in ([0, 1], [2, 3, 4], [5]):
        s, _ = _layers_stats(moe, x[rows], None)
        parts = parts + sum(router_losses(s, E, "sequence", items[rows], int(items.sum())))
    parts.backward()
    assert abs(parts.item() - whole.item()) <= 1e-6
    assert (moe.gate.weight.grad - grad_whole).abs().max().item() <= 1e-6


def test_batch_share_is_the_share_of_items():
    moe = make_moe(routing_policy="dropless")
    stats, _ = _layers_stats(moe, torch.randn(2, 5, H), None)
    aux, _ = router_losses(stats, E, "batch")
    share, _ = router_losses(stats, E, "batch", torch.tensor([4, 4]), 32)
    assert math.isclose(share.item(), aux.item() * 8 / 32, rel_tol=1e-6)


def test_model_logs_router_metrics():
    model = mf.AutoModelForCausalLM.from_pretrained("gpt_moe_tiny", num_hidden_layers=2, hidden_size=64,
                                                    vocab_size=128).train()
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids, labels=ids)
    assert out.aux_loss is not None and out.router_logits[0].shape == (32, 8)
    sums = model.training_metrics.pop("cpu")
    logs = model.training_metrics.summarize(sums, steps=1)
    assert abs(sum(logs[f"expert_load/{i}"] for i in range(8)) - 1) <= 1e-6
    assert logs["load_imbalance"] >= 1 and abs(logs["aux_loss"] - out.aux_loss.item()) <= 1e-5
    assert model.training_metrics.pop("cpu")["aux_loss"] == 0  # popped: the next log starts from zero
    model.eval()
    model(ids, labels=ids)  # evaluation is not counted
    assert model.training_metrics.pop("cpu")["router_stats"].sum() == 0


def test_expert_loads_are_logged_without_the_router_loss():
    """A Qwen3-MoE checkpoint sets output_router_logits false: the loss is the language model's alone (as in
    transformers), and the run's logs still get each layer's expert load (they were all zeros); nothing counted
    logs nothing rather than zeros."""
    model = mf.AutoModelForCausalLM.from_pretrained("qwen3_moe_tiny", num_hidden_layers=2, hidden_size=64,
                                                    vocab_size=128, output_router_logits=False).train()
    ids = torch.randint(0, 128, (2, 16))
    out = model(ids, labels=ids)
    tracker = model.training_metrics
    logs = tracker.summarize(tracker.pop("cpu"), steps=1)
    assert abs(sum(v for k, v in logs.items() if k.startswith("expert_load/")) - 1) <= 1e-6
    assert all(logs[f"load_imbalance/layer_{i}"] >= 1 for i in tracker.moe_layers)
    assert tracker.summarize(tracker.pop("cpu"), steps=1) == {}
    assert out.aux_loss is None and out.loss < model(ids, labels=ids, output_router_logits=True).loss


def test_expert_load_is_logged_per_layer():
    """Each MoE layer's most loaded expert against its mean, and its dropped share, from the summed statistics:
    layer 0 balanced, layer 2 routing everything to expert 1 and dropping a quarter (layer 1 is dense)."""
    from mindformers_py.layers.moe.layer import RouterMetrics, stat_width

    metrics = RouterMetrics(3, 4, 2, [0, 2], capacity_limited=True, z_loss=False)
    cols = stat_columns(4)
    stats = torch.zeros(3, stat_width(4), dtype=torch.float64)
    stats[0, cols["counts"]] = torch.tensor([5.0, 5, 5, 5])
    stats[2, cols["counts"]] = torch.tensor([0.0, 20, 0, 0])
    stats[[0, 2], cols["tokens"]] = 10.0  # 10 tokens x top-2 = 20 assignments per layer
    stats[2, cols["dropped"]] = 5.0
    logs = metrics.summarize({"router_stats": stats, "aux_loss": torch.tensor(0.0), "z_loss": torch.tensor(0.0)}, 1)
    assert logs["load_imbalance/layer_0"] == 1.0 and logs["load_imbalance/layer_2"] == 4.0
    assert "load_imbalance/layer_1" not in logs and logs["load_imbalance"] == 2.5
    assert (logs["dropped_tokens/layer_0"], logs["dropped_tokens/layer_2"], logs["dropped_tokens"]) == (0.0, 0.25, 0.125)


@pytest.mark.parametrize(("fields", "fragments"), [
    ({"expert_num": 4, "num_experts_chosen": 5}, ["num_experts_chosen=5", "expert_num=4", "1..4"]),
    ({"expert_num": 4, "capacity_factor": 0.5}, ["capacity_factor=0.5", "routing_policy='topk'", ">= 1"]),
    ({"expert_num": 4, "aux_loss_scope": "global"}, ["aux_loss_scope='global'", "'batch', 'sequence'"]),
    ({"expert_num": 4, "router_dense_type": "int8"}, ["router_dense_type='int8'", "'float32'"]),
    ({"expert_num": 4, "use_shared_expert_gating": True}, ["use_shared_expert_gating=True", "shared_expert_num=0"]),
])
def test_moe_config_errors_name_the_field(fields, fragments):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**fields)
    assert all(f in str(err.value) for f in fragments) and "\n" not in str(err.value), str(err.value)
    assert MoEConfig(expert_num=4, capacity_factor=0.5, routing_policy="dropless").expert_capacity(8) is None


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"moe_config": {"expert_num": 4, "mlp_only_layers": [5]}}, "moe_config.mlp_only_layers=[5]"),
    ({"moe_config": {"expert_num": 4}, "mlp_bias": True}, "mlp_bias=True"),
    ({"moe_config": {"expert_num": 4, "num_experts_chosen": 8}}, "moe_config.num_experts_chosen=8"),
    ({"moe_config": {"expert_num": 4, "capacity_factor": 0.9}}, "moe_config.capacity_factor=0.9"),
])
def test_gpt_config_moe_errors(fields, fragment):
    with pytest.raises(ConfigError) as err:
        mf.GPTConfig(flavour="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **fields)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("moe", [
    {"expert_num": 8, "num_experts_chosen": 2, "moe_intermediate_size": 48},
    {"expert_num": 4, "num_experts_chosen": 2, "moe_intermediate_size": 24, "shared_expert_num": 2,
     "use_shared_expert_gating": True, "mlp_only_layers": [1]},
])
def test_planner_reads_gpt_moe_configs(moe):
    """The planner's shape of a GPT-MoE config counts the model's parameters exactly, and expert parallelism
    divides the expert state it holds per rank."""
    from mindformers_py.parallel import ParallelConfig
    from mindformers_py.planner.shape_readers import as_shape
    from mindformers_py.planner.search import estimate_memory

    config = mf.GPTConfig(flavour="llama", vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, moe_config=moe)
    shape = as_shape(config)
    model = mf.GPTForCausalLM(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert shape.expert_stack_params() == experts and shape.num_moe_layers == len(config.moe_layers())
    plain = estimate_memory(config, ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=4), 1, 16)
    split = estimate_memory(config, ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=4,
                                                   expert_parallel=4), 1, 16)
    assert plain.parameters - split.parameters == 4 * experts * 3 // 4  # fp32: three quarters of the experts less


def test_grouped_kernel_and_per_expert_products_agree(monkeypatch):
    """Where torch has no grouped-GEMM kernel the experts run one product per expert: same outputs and gradients."""
    import mindformers_py.layers.moe.layer as moe_module

    results = []
    for kernel in (True, False):
        monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda *args, kernel=kernel: kernel)
        moe = make_moe(routing_policy="dropless")
        x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out, _ = moe(x)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        results.append((out.detach(), x.grad, moe.experts.gate_proj.grad, moe.experts.up_proj.grad,
                        moe.experts.down_proj.grad))
    for grouped, looped in zip(*results):
        assert (grouped - looped).abs().max().item() <= 1e-5


def test_training_keeps_no_side_by_side_copy_of_the_gate_and_up_weights():
    """The gate and up projections run as one grouped product over the two weights side by side; that copy (as
    large as both weights: 0.75 GiB per layer of Qwen3-30B-A3B in bf16) is rebuilt in backward, never saved for it,
    so a training step holds no extra weight-sized tensor per MoE layer."""
    moe = make_moe(routing_policy="dropless")
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = moe(x)
    weights = {p.data_ptr() for p in moe.experts.parameters()}
    copies = [tuple(t.shape) for t in saved if t.numel() >= E * I * H and t.data_ptr() not in weights]
    assert copies == []
    out.sum().backward()  # and backward still runs on what was saved
    assert moe.experts.gate_proj.grad is not None and x.grad is not None


def test_half_precision_experts_whose_rows_are_not_16_byte_multiples_run():
    """Found by transformers' common model tests on Qwen3-MoE (they fail there too): experts 12 wide in bf16 have
    24-byte rows, which torch's grouped products refuse; those experts run one product per expert."""
    torch.manual_seed(0)
    moe = MoE(H, 12, MoEConfig(expert_num=E, num_experts_chosen=2, routing_policy="dropless"), act="silu", gated=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3))
    reference, _ = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = moe(x)
    torch.testing.assert_close(out.float(), reference, rtol=5e-2, atol=5e-2)
    half, _ = moe.to(torch.float16)(x.half())
    torch.testing.assert_close(half.float(), reference, rtol=5e-2, atol=5e-2)


def test_bf16_grouped_products_pad_each_experts_rows_without_changing_results(monkeypatch):
    """On the CPU in bf16 each expert's rows are padded to a multiple of a granularity (so oneDNN sees few shapes):
    outputs and gradients equal those of the unpadded grouped products, and the padding really happens."""
    import mindformers_py.layers.moe.layer as moe_module

    calls = []
    original_of = moe_module._PaddedGroups.of.__func__

    def recording_of(cls, counts, num_rows):
        padded = original_of(cls, counts, num_rows)
        calls.append(padded)
        return padded

    results = []
    for pad in (True, False):
        monkeypatch.setattr(moe_module._PaddedGroups, "MIN_GRANULARITY", 8 if pad else 10**9)
        monkeypatch.setattr(moe_module._PaddedGroups, "of", classmethod(recording_of))
        moe = make_moe(routing_policy="dropless")
        x = torch.randn(4, 64, H, generator=torch.Generator().manual_seed(3), requires_grad=True)  # 512 rows
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = moe(x)
        (out.float() * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        results.append((out.detach().float(), x.grad, moe.experts.up_proj.grad, moe.experts.down_proj.grad))
    padded = calls[0]
    assert padded is not None and calls[1] is None
    assert padded.granularity == 16 and bool((padded.padded_counts % 16 == 0).all())
    assert padded.padded_rows > 512  # rows were added
    for with_padding, without in zip(*results):
        torch.testing.assert_close(with_padding, without, rtol=1e-2, atol=1e-3)


def test_peft_lora_trains_a_gpt_moe():
    """peft's defaults for our model type (Llama's q_proj/v_proj) apply to GPT-MoE; the router loss trains through
    the adapters and only they get gradients."""
    from peft import LoraConfig, get_peft_model

    model = mf.AutoModelForCausalLM.from_pretrained("gpt_moe_tiny", num_hidden_layers=2, hidden_size=64, vocab_size=128)
    peft_model = get_peft_model(model, LoraConfig(r=4))
    ids = torch.randint(0, 128, (2, 12))
    out = peft_model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None
    out.loss.backward()
    trained = {n for n, p in peft_model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
