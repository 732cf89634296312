"""The lean encoder-decoder decode loop: token-identical to transformers' ``generate`` on the same weights (greedy,
sampling, processors, eos, padded sources, several sequences per source), actually taken, and refusing
impossible requests in one line."""

import pytest
import torch
from transformers import TextIteratorStreamer

import mindformers_py as mf
import mindformers_py.generation.fast_generate as seq2seq
from support.t5_models import VOCAB, batch, load_hf, save_tiny_hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = save_tiny_hf("t5_v1_1", tmp_path_factory.mktemp("gen") / "hf")
    return load_hf(path, "t5_v1_1"), mf.AutoModelForSeq2SeqLM.from_pretrained(path)


@pytest.fixture
def lean_calls(monkeypatch):
    calls = []
    original = seq2seq.decode_seq2seq

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(seq2seq, "decode_seq2seq", spy)
    return calls


CASES = [
    dict(do_sample=False),
    dict(do_sample=False, eos_token_id=None),
    dict(do_sample=True, top_k=5, temperature=0.7),
    dict(do_sample=True, top_p=0.8, num_return_sequences=2),
    dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(do_sample=False, min_new_tokens=10, encoder_repetition_penalty=1.2),
]


@pytest.mark.parametrize("options", CASES)
def test_lean_loop_matches_transformers(models, lean_calls, options):
    hf, ours = models
    ids, mask, _ = batch(4, rows=3, source=12)
    kw = dict(attention_mask=mask, max_new_tokens=16, **options)
    torch.manual_seed(0)
    lean = ours.generate(ids, **kw)
    assert lean_calls, "the lean loop was not taken"
    torch.manual_seed(0)
    mixin = ours.generate(ids, fast_generate=False, **kw)
    torch.manual_seed(0)
    reference = hf.generate(ids, **kw)
    assert torch.equal(lean, reference) and torch.equal(mixin, reference)


def test_unmasked_padded_source_as_transformers(models, lean_calls):
    """transformers infers no source mask for encoder-decoders (pads are attended); neither does the lean loop."""
    hf, ours = models
    ids, mask, _ = batch(4, rows=3, source=12)
    ids[mask == 0] = 0
    assert torch.equal(ours.generate(ids, max_new_tokens=8), hf.generate(ids, max_new_tokens=8))
    assert lean_calls


def test_beam_search_and_dict_outputs_take_generation_mixin(models, lean_calls):
    hf, ours = models
    ids, mask, _ = batch(5, rows=2, source=14)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=3)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
    assert not lean_calls


def test_streamer_receives_the_tokens(models):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="t2"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t1", unk_token="t2")
    hf, ours = models
    ids, _, _ = batch(6, rows=1, source=7)
    streamer = TextIteratorStreamer(tokenizer, skip_special_tokens=True)
    out = ours.generate(ids, max_new_tokens=6, streamer=streamer, eos_token_id=None)
    assert "".join(streamer).split() == tokenizer.decode(out[0], skip_special_tokens=True).split()


def test_impossible_requests_are_one_line_errors(models):
    hf, ours = models
    ids = torch.randint(2, VOCAB, (1, 600))
    # relative positions have no end: a source past n_positions (512) runs, as in transformers
    assert torch.equal(ours.generate(ids, max_new_tokens=4), hf.generate(ids, max_new_tokens=4))
    with pytest.raises(mf.ConfigError, match="decoder_start_token_id is None"):
        ours.generate(ids[:, :5], max_new_tokens=4, decoder_start_token_id=None, bos_token_id=None)
