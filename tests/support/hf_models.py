"""Tiny random HF reference models of every architecture the GPT family loads (built locally, no hub)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


def tiny_hf_config(kind: str):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, **common)
    if kind == "llama":
        return transformers.LlamaConfig(**llama_like)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=None, **llama_like)
    if kind == "qwen2":
        return transformers.Qwen2Config(**llama_like)
    if kind == "mixtral":  # 4 experts, top-2; every MLP routed
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                          router_aux_loss_coef=0.02, **{**llama_like, "intermediate_size": 48})
    if kind == "qwen2_moe":  # 4 experts of 24, top-2, raw top-k probabilities, a gated shared expert; layer 1 dense
        return transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[1],
                                           router_aux_loss_coef=0.02, **{**llama_like, "num_hidden_layers": 3})
    if kind == "qwen3":  # head_dim 16 (not hidden/heads), biases on q/k/v/o, per-head q/k norms; layer 1 slides
        return transformers.Qwen3Config(head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=5,
                                        max_window_layers=1, **llama_like)
    if kind == "qwen3_moe":  # 4 experts of 24, top-2 renormalised, no shared expert, per-head q/k norms; layer 1 dense
        return transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           norm_topk_prob=True, mlp_only_layers=[1], head_dim=16,
                                           router_aux_loss_coef=0.02, **{**llama_like, "num_hidden_layers": 3})
    if kind in ("deepseek_v3", "deepseek_v3_moe"):
        return tiny_deepseek_v3_config(moe=kind == "deepseek_v3_moe")
    raise ValueError(kind)


def tiny_deepseek_v3_config(moe: bool = True, **overrides):
    """DeepSeek-V3's shape in miniature: latent attention (a query latent of 24, a key/value latent of 16, heads of
    8 + 4 rotary / 12 value dims, interleaved rotary pairs, YaRN with mscale in the softmax scale); with ``moe``, 4
    layers, the first dense, then 8 routed experts of 16 in 4 groups (top-2 of the best 2 groups) beside a shared
    one; without, 3 dense layers (every layer below first_k_dense_replace)."""
    layers = 4 if moe else 3
    fields = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                  q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                  moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  first_k_dense_replace=1 if moe else layers, rope_interleave=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                                   "beta_slow": 1})
    return transformers.DeepseekV3Config(**{**fields, **overrides})


def tiny_hf_model(kind: str, head: str = "causal_lm", **overrides):
    """A seeded tiny HF model with non-trivial weights (biases and norms randomised too)."""
    torch.manual_seed(1234)
    config = tiny_hf_config(kind)
    for k, v in overrides.items():
        setattr(config, k, v)
    cls = {"causal_lm": transformers.AutoModelForCausalLM,
           "sequence_classification": transformers.AutoModelForSequenceClassification,
           "token_classification": transformers.AutoModelForTokenClassification,
           "question_answering": transformers.AutoModelForQuestionAnswering}[head]
    model = cls.from_config(config).eval()
    with torch.no_grad():  # default init leaves biases at 0 and norms at 1, which would hide mapping mistakes
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def saved_hf_model(kind: str, tmp_path_factory) -> tuple[str, "transformers.PreTrainedModel", object]:
    """(kind, the tiny HF causal LM, the folder it was saved to): what a module-scoped parity fixture returns."""
    model = tiny_hf_model(kind)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    return kind, model, path


def ours_and_theirs(saved) -> tuple:
    """(our GPTForCausalLM loaded from a :func:`saved_hf_model` folder, transformers' model)."""
    import mindformers_py as mf

    kind, hf, path = saved
    ours = mf.AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(ours, mf.GPTForCausalLM) and ours.config.hf_architecture == kind
    return ours, hf


def assert_same_hidden_states_and_attentions(ours, hf, ids: torch.Tensor, tol: float) -> None:
    """Under eager attention, our model returns transformers' hidden states and attention weights (as many, each
    within ``tol``) for ``output_hidden_states`` and ``output_attentions``."""
    ours.set_attn_implementation("eager")
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        a = ours(ids, output_hidden_states=True, output_attentions=True)
        b = hf(ids, output_hidden_states=True, output_attentions=True)
    assert len(a.hidden_states) == len(b.hidden_states) and len(a.attentions) == len(b.attentions)
    for x, y in zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions):
        assert (x - y).abs().max().item() <= tol
