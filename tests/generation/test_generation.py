"""model.generate: the lean static-cache loop gives the same tokens as transformers' GenerationMixin loop (and as a
no-cache argmax loop, and as HF's own models), for greedy, sampling, eos, padding and streaming; the rest falls back."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache, TextStreamer

import mindformers_py as mf
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer
from mindformers_py.generation import StaticKVCache, fast_generate
from mindformers_py.generation import skinny_linear
from mindformers_py.generation.skinny_linear import skinny_linear_kernels
from support.hf_models import VOCAB, tiny_hf_model

PAD = 0


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tmp_path_factory):
    """(HF model, our model loaded from its checkpoint)."""
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, mf.AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the generate calls that ran the lean loop."""
    calls = []
    original = fast_generate._decode

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fast_generate, "_decode", spy)
    return calls


def left_padded(lengths, seed=0):
    """Random prompts of the given lengths, left-padded with PAD, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def test_greedy_with_cache_equals_no_cache_argmax_loop(models, lean_calls):
    _, ours = models
    ids = torch.randint(3, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = ours.generate(ids, **kwargs)
    seq = ids
    with torch.no_grad():
        for _ in range(10):
            next_token = ours(seq, use_cache=False).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, next_token[:, None]], dim=-1)
    assert lean_calls and torch.equal(out, seq)
    assert not out.is_inference()  # usable as training input (e.g. model(out, labels=out).loss.backward())
    assert torch.equal(ours.generate(ids, fast_generate=False, **kwargs), seq)


LEAN_REQUESTS = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    "sample_repetition_penalty": dict(do_sample=True, repetition_penalty=1.3),
    "greedy_penalties": dict(do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=2),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3, temperature=1.3),
    "min_new_tokens": dict(do_sample=False, min_new_tokens=6),
}


@pytest.mark.parametrize("request_name", LEAN_REQUESTS)
def test_lean_loop_equals_generation_mixin(models, lean_calls, request_name):
    _, ours = models
    ids, mask = left_padded([6, 9, 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, eos_token_id=5, **LEAN_REQUESTS[request_name])
    torch.manual_seed(7)
    lean = ours.generate(ids, **kwargs)
    assert lean_calls, "the request should have run the lean loop"
    torch.manual_seed(7)
    reference = ours.generate(ids, fast_generate=False, **kwargs)
    assert len(lean_calls) == 1
    assert torch.equal(lean, reference)


def test_sliding_window_model_lean_loop_equals_generation_mixin(lean_calls):
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)
    model = mf.GPTForCausalLM(config).eval()
    ids, mask = left_padded([3, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    lean = model.generate(ids, **kwargs)
    assert lean_calls and torch.equal(lean, model.generate(ids, fast_generate=False, **kwargs))
    seq, seq_mask = ids, mask  # no-cache reference: full forward over the padded sequence at every step
    with torch.no_grad():
        for _ in range(10):
            pos = (seq_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(seq, attention_mask=seq_mask, position_ids=pos, use_cache=False).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1)[:, None]], dim=-1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=-1)
    assert torch.equal(lean, seq)


def test_sampling_matches_hf_models_sample_path(models):
    hf, ours = models
    ids, mask = left_padded([5, 8])
    kwargs = dict(attention_mask=mask, max_new_tokens=15, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, pad_token_id=PAD)
    torch.manual_seed(3)
    expected = hf.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(ours.generate(ids, **kwargs), expected)


def test_sampling_is_reproducible_and_top_k_1_is_greedy(models):
    _, ours = models
    ids = torch.randint(3, VOCAB, (2, 6))
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=1.5, eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(11)
    first = ours.generate(ids, **kwargs)
    torch.manual_seed(11)
    assert torch.equal(ours.generate(ids, **kwargs), first)
    torch.manual_seed(12)
    assert not torch.equal(ours.generate(ids, **kwargs), first)  # the seed matters: it is really sampling
    greedy = ours.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(ours.generate(ids, **{**kwargs, "top_k": 1}), greedy)


def test_eos_stops_generation(models):
    _, ours = models
    ids = torch.randint(3, VOCAB, (2, 6))
    # no_repeat_ngram_size=1 makes every generated token new, so eos can be chosen to occur once, mid-sequence.
    kwargs = dict(max_new_tokens=12, do_sample=False, no_repeat_ngram_size=1, pad_token_id=PAD)
    free = ours.generate(ids, eos_token_id=None, **kwargs)
    new = free[:, 6:]
    stop = 4
    eos = int(new[0, stop])
    # Batch of one: stops right after eos.
    single = ours.generate(ids[:1], eos_token_id=eos, **kwargs)
    assert torch.equal(single[0], free[0, : 6 + stop + 1]) and not single.is_inference()
    # Batch of two: the finished row is padded while the other goes on until it ends too (or reaches max_new_tokens).
    both = ours.generate(ids, eos_token_id=eos, **kwargs)
    assert torch.equal(both[0, : 6 + stop + 1], free[0, : 6 + stop + 1])
    assert (both[0, 6 + stop + 1 :] == PAD).all()
    other = new[1].tolist()
    end = other.index(eos) + 1 if eos in other else len(other)
    assert both.shape[1] == 6 + max(stop + 1, end)
    assert torch.equal(both[1, 6 : 6 + end], new[1, :end])
    assert torch.equal(both, ours.generate(ids, eos_token_id=eos, fast_generate=False, **kwargs))


def test_left_padded_batch_equals_single_prompts(models):
    _, ours = models
    lengths = [5, 8, 3]
    ids, mask = left_padded(lengths, seed=4)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    batch = ours.generate(ids, attention_mask=mask, **kwargs)
    for row, n in enumerate(lengths):
        single = ours.generate(ids[row : row + 1, -n:], **kwargs)
        assert torch.equal(batch[row, -10:], single[0, -10:])


@pytest.fixture(scope="module")
def text_model():
    """A tiny GPT with a byte-level BPE tokenizer trained here."""
    texts = ["def main():\n    return 0\n", "hello world, hello there", "the quick brown fox jumps over the lazy dog"] * 10
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    torch.manual_seed(0)
    config = mf.GPTConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64
    )
    return tokenizer, mf.GPTForCausalLM(config).eval()


class RecordingStreamer(TextStreamer):
    """A TextStreamer that keeps the text it would print."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.pieces: list[str] = []
        self.ended = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)
        self.ended = self.ended or stream_end


@pytest.mark.parametrize("fast", [True, False])
def test_text_streamer_receives_the_generated_text(text_model, fast):
    tokenizer, model = text_model
    prompt = tokenizer("def main", return_tensors="pt")
    streamer = RecordingStreamer(tokenizer)
    out = model.generate(**prompt, streamer=streamer, max_new_tokens=15, do_sample=False, fast_generate=fast,
                         eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    new_text = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert streamer.ended and "".join(streamer.pieces) == new_text and new_text


def test_unsupported_requests_fall_back_to_generation_mixin(models, lean_calls):
    _, ours = models
    ids = torch.randint(3, VOCAB, (2, 6))
    kwargs = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=PAD)
    greedy = ours.generate(ids, do_sample=False, **kwargs)
    assert len(lean_calls) == 1
    dict_out = ours.generate(ids, do_sample=False, return_dict_in_generate=True, output_scores=True, **kwargs)
    assert torch.equal(dict_out.sequences, greedy) and len(dict_out.scores) == 8
    beams = ours.generate(ids, num_beams=2, do_sample=False, **kwargs)
    assert beams.shape == greedy.shape
    ours.fast_generate = False
    try:
        assert torch.equal(ours.generate(ids, do_sample=False, **kwargs), greedy)
    finally:
        del ours.fast_generate
    assert len(lean_calls) == 1


@pytest.mark.parametrize("extra", [{}, {"num_beams": 2}])
def test_prompt_too_long_for_the_context_is_a_clear_error(models, extra):
    hf, ours = models  # max_position_embeddings = 64
    if ours.config.position_limit is None:  # rotary positions have no end: transformers generates past it, as we do
        ids = torch.randint(3, VOCAB, (1, 60))
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, **extra)
        assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
        return
    with pytest.raises(mf.MindFormersError, match=r"the prompt has 70 tokens, which leaves no room in .* of 64"):
        ours.generate(torch.randint(3, VOCAB, (1, 70)), max_new_tokens=5, **extra)
    with pytest.raises(mf.MindFormersError, match=r"the prompt has 64 tokens, which leaves no room"):
        ours.generate(torch.randint(3, VOCAB, (1, 64)), **extra)  # default max_length
    too_long = r"prompt of 60 tokens \+ max_new_tokens=10 = 70 .*context length of 64.*at most 4"
    with pytest.raises(mf.MindFormersError, match=too_long):
        ours.generate(torch.randint(3, VOCAB, (1, 60)), max_new_tokens=10, **extra)


def test_static_kv_cache_equals_dynamic_cache(models):
    _, ours = models
    ids = torch.randint(3, VOCAB, (2, 9))
    static, dynamic = StaticKVCache(ours.config.num_hidden_layers, 12), DynamicCache()
    with torch.no_grad():
        a = ours(ids[:, :6], past_key_values=static, use_cache=True).logits
        b = ours(ids[:, :6], past_key_values=dynamic, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-6)
        for t in range(6, 9):
            a = ours(ids[:, t : t + 1], past_key_values=static, use_cache=True).logits
            b = ours(ids[:, t : t + 1], past_key_values=dynamic, use_cache=True).logits
            assert torch.allclose(a, b, atol=1e-6)
        assert static.get_seq_length() == 9
        static.crop(-2)
        dynamic.crop(-2)
        a = ours(ids[:, 7:9], past_key_values=static, use_cache=True).logits
        b = ours(ids[:, 7:9], past_key_values=dynamic, use_cache=True).logits
        assert static.get_seq_length() == 9 and torch.allclose(a, b, atol=1e-6)
        with pytest.raises(mf.MindFormersError, match="max_cache_len=12"):
            ours(ids[:, :4], past_key_values=static, use_cache=True)
    # GenerationMixin accepts it as a user cache.
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    with_static = ours.generate(ids, past_key_values=StaticKVCache(ours.config.num_hidden_layers, 15), **kwargs)
    assert torch.equal(with_static, ours.generate(ids, **kwargs))


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("formulation", ["linear", "weight_first", "transposed"])
def test_skinny_linear_kernels_compute_linear_and_restore(rows, formulation, monkeypatch):
    monkeypatch.setattr(skinny_linear, "fastest_formulation", lambda *args: formulation)  # each one, whatever wins here
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16, bias=False))
    x = torch.randn(rows, 1, 32)
    expected = model(x)
    weights = [p.clone() for p in model.parameters()]
    with skinny_linear_kernels(model, rows):
        switched = rows <= 16 and formulation != "linear"
        assert all("forward" in m.__dict__ for m in model if isinstance(m, nn.Linear)) == switched
        got = model(x)
        assert torch.allclose(model(x[:1, :, :]), expected[:1], atol=1e-5)  # another row count: F.linear
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in model)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_fastest_formulation_is_measured_once_per_shape():
    weight = torch.randn(24, 8)
    rng = torch.get_rng_state()
    chosen = skinny_linear.fastest_formulation(weight, None, 2, allow_copy=False)
    assert torch.equal(torch.get_rng_state(), rng)  # measuring leaves a seeded sampling call's tokens alone
    assert chosen in ("linear", "weight_first")  # the copy was not allowed
    skinny_linear._FASTEST[(24, 8, 2, torch.float32, torch.get_num_threads(), False)] = "weight_first"
    assert skinny_linear.fastest_formulation(weight, None, 2, allow_copy=False) == "weight_first"  # cached
