"""The language-model heads score contiguous hidden states: ``generate``'s ``logits_to_keep=1`` slices the last
position of the prompt, a strided view that ``F.linear`` would run as a batched ``matmul`` copying the whole head
weight (in bf16 on a CPU, torch 2.13: 5.4 s and 0.58 GiB for one token at Qwen3's vocabulary)."""

from __future__ import annotations

import pytest
import torch

import mindformers_py as mf

VOCAB = 4096


def gpt() -> torch.nn.Module:
    return mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64))


def t5() -> torch.nn.Module:
    return mf.AutoModelForSeq2SeqLM.from_config(mf.AutoConfig.for_model(
        "mindformers_t5", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        decoder_start_token_id=0))


def head_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    return seen


def row_major(x: torch.Tensor) -> bool:
    return x.stride() == torch.empty(x.shape).stride()


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("build", [gpt, t5])
def test_the_last_position_reaches_the_head_as_a_fresh_row_with_the_same_logits(build, rows):
    """One row of a sequence's strides (``is_contiguous()`` says True for it) would still take the copying path."""
    torch.manual_seed(0)
    model = build().eval()
    seen = head_inputs(model)
    prompt = torch.randint(1, VOCAB, (rows, 7))
    kwargs = {"decoder_input_ids": torch.zeros(rows, 5, dtype=torch.long)} if build is t5 else {}
    with torch.no_grad():
        last = model(prompt, logits_to_keep=1, **kwargs).logits
        whole = model(prompt, **kwargs).logits
    assert seen and all(row_major(x) for x in seen)
    assert seen[0].shape[1] == 1
    torch.testing.assert_close(last[:, -1], whole[:, -1])


def test_a_bf16_head_scores_the_last_prompt_position_without_copying_its_weight():
    """``generate``'s first call in bf16 (``logits_to_keep=1``): no allocation as large as the head's weight."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = gpt().to(torch.bfloat16).eval().requires_grad_(False)  # (frozen, as a LoRA run's head)
    weight_bytes = model.lm_head.weight.numel() * 2
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(torch.randint(1, VOCAB, (1, 9)), logits_to_keep=1)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest < weight_bytes, f"an allocation of {largest} bytes (the head's weight is {weight_bytes})"
