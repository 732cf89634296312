"""The compiled decode step (``generate(..., cache_implementation="static")``): the same tokens as transformers'
``generate`` for a decoder-only and an encoder-decoder model, unpadded and left-padded, compiled once per model and
reused by later calls; ``disable_compile`` keeps the eager steps. Dynamo captures the graphs with the ``eager``
backend (``compile_config``), so the test checks the wiring without waiting for inductor's code generation."""

import torch
from transformers import CompileConfig

import mindformers_py as mf
from mindformers_py.generation import compiled_step
from support.hf_models import VOCAB, tiny_hf_model
from support.t5_models import batch, load_hf, save_tiny_hf

CAPTURE_ONLY = CompileConfig(backend="eager")


def test_compiled_decoder_step_gives_transformers_tokens_and_is_compiled_once(tmp_path):
    hf = tiny_hf_model("gpt2").eval()
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # a left-padded row
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf.generate(ids, attention_mask=mask, **kw)
    for _ in range(2):
        out = ours.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=CAPTURE_ONLY, **kw)
        assert torch.equal(out, expected)
    assert len(compiled_step._COMPILED[ours]) == 1  # one compiled forward, reused by the second call
    before = dict(compiled_step._COMPILED[ours])
    eager = ours.generate(ids, attention_mask=mask, cache_implementation="static", disable_compile=True, **kw)
    assert torch.equal(eager, hf.generate(ids, attention_mask=mask, **kw)) and compiled_step._COMPILED[ours] == before


def test_compiled_encoder_decoder_step_gives_transformers_tokens(tmp_path):
    path = save_tiny_hf("t5_v1_1", tmp_path / "hf")
    hf, ours = load_hf(path, "t5_v1_1"), mf.AutoModelForSeq2SeqLM.from_pretrained(path)
    ids, mask, _ = batch(4, rows=3, source=12)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = ours.generate(ids, cache_implementation="static", compile_config=CAPTURE_ONLY, **kw)
    assert torch.equal(out, hf.generate(ids, **kw)) and ours in compiled_step._COMPILED
