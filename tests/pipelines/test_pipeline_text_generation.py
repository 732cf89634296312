"""mindformers_py.pipeline("text-generation"): same results as transformers.pipeline on the same weights, from a model
object, our checkpoint folder, an HF checkpoint folder or a preset; transformers.pipeline runs on our checkpoints."""

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer

PROMPTS = ["def main(", "hello world", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF GPT-2 with its tokenizer, and the same checkpoint converted to ours (tokenizer copied along)."""
    texts = ["def main():\n    return 0\n", "hello world, hello there", "the quick brown fox jumps over the lazy dog"] * 10
    root = tmp_path_factory.mktemp("pipeline")
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300, save_dir=root / "hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(root / "hf")
    mf.convert_checkpoint(root / "hf", root / "ours", to="mindformers")
    return hf, tokenizer, root / "hf", root / "ours"


CALLS = {
    "greedy": dict(max_new_tokens=10, do_sample=False),
    "new_text_only": dict(max_new_tokens=8, do_sample=False, return_full_text=False),
    "sampling": dict(max_new_tokens=8, do_sample=True, top_k=10, temperature=0.8, num_return_sequences=2),
    "batched": dict(max_new_tokens=6, do_sample=False, batch_size=2),
    "tensors": dict(max_new_tokens=5, do_sample=False, return_tensors=True),
}


def _run(pipe, prompts, kwargs):
    torch.manual_seed(5)
    return pipe(prompts, **kwargs)


def _same(a, b):
    """Pipeline outputs equal, comparing token-id tensors by value."""
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("call", CALLS)
def test_results_equal_transformers_pipeline(checkpoints, call):
    hf, tokenizer, _, ours_dir = checkpoints
    ours = mf.pipeline("text-generation", model=ours_dir)
    assert isinstance(ours.model, mf.GPTForCausalLM)
    theirs = transformers.pipeline("text-generation", model=hf, tokenizer=tokenizer)
    kwargs = CALLS[call]
    prompts = PROMPTS if call in ("batched", "sampling") else PROMPTS[0]
    expected = _run(theirs, prompts, kwargs)
    assert _same(_run(ours, prompts, kwargs), expected)
    if call == "new_text_only":
        assert not expected[0]["generated_text"].startswith(PROMPTS[0])


def test_model_object_hf_folder_and_alias(checkpoints):
    hf, tokenizer, hf_dir, ours_dir = checkpoints
    kwargs = dict(max_new_tokens=7, do_sample=False)
    expected = _run(transformers.pipeline("text-generation", model=hf, tokenizer=tokenizer), PROMPTS, kwargs)
    model = mf.AutoModelForCausalLM.from_pretrained(ours_dir)
    assert _same(_run(mf.pipeline("text_generation", model=model, tokenizer=tokenizer), PROMPTS, kwargs), expected)
    from_hf_folder = mf.pipeline("text-generation", model=hf_dir)
    assert isinstance(from_hf_folder.model, mf.GPTForCausalLM)
    assert _same(_run(from_hf_folder, PROMPTS, kwargs), expected)


def test_transformers_pipeline_runs_on_our_checkpoint(checkpoints):
    _, _, _, ours_dir = checkpoints
    theirs = transformers.pipeline("text-generation", model=str(ours_dir))
    assert isinstance(theirs.model, mf.GPTForCausalLM)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    assert _same(_run(theirs, PROMPTS, kwargs), _run(mf.pipeline("text-generation", model=ours_dir), PROMPTS, kwargs))


def test_preset_needs_a_tokenizer(checkpoints):
    _, tokenizer, _, _ = checkpoints
    with pytest.raises(mf.MindFormersError, match="tokenizer=... when the model is a preset"):
        mf.pipeline("text-generation", model="gpt_tiny")
    out = mf.pipeline("text-generation", model="gpt_tiny", tokenizer=tokenizer)("def main(", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("def main(")


def test_default_length_fits_the_context(checkpoints):
    _, tokenizer, _, ours_dir = checkpoints
    pipe = mf.pipeline("text-generation", model=ours_dir, eos_token_id=None)  # pipeline default: 256 new tokens
    out = pipe("def main(", return_tensors=True, do_sample=False)
    assert len(out[0]["generated_token_ids"]) == 64  # prompt + new tokens = the context length


def test_bad_input_is_a_clear_error(checkpoints, tmp_path):
    _, tokenizer, _, ours_dir = checkpoints
    with pytest.raises(mf.MindFormersError, match="task='write_poems' is not valid; choose one of: .*'text-generation', 'text_gen"):
        mf.pipeline("write_poems", model=ours_dir)
    with pytest.raises(mf.MindFormersError, match="needs model="):
        mf.pipeline("text-generation")
    pipe = mf.pipeline("text-generation", model=ours_dir)
    with pytest.raises(mf.MindFormersError, match=r"the prompt has \d+ tokens, which leaves no room in .* of 64"):
        pipe("hello world " * 40, max_new_tokens=10)
    prompt = "hello world " * 14
    length = len(tokenizer(prompt)["input_ids"])
    assert length + 10 > 64 > length
    too_long = rf"prompt of {length} tokens \+ max_new_tokens=10 = {length + 10} tokens exceeds the model's context length of 64"
    with pytest.raises(mf.MindFormersError, match=too_long):
        pipe(prompt, max_new_tokens=10)
    model = mf.AutoModelForCausalLM.from_pretrained(ours_dir)
    model.save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(mf.CheckpointError, match="no tokenizer could be loaded from"):
        mf.pipeline("text-generation", model=tmp_path / "no_tokenizer")


def test_loading_arguments_load_the_model_as_in_transformers(checkpoints):
    """pipeline()'s loading arguments (model_kwargs, device_map, revision, use_fast, ...) load the model and the
    tokenizer, as transformers.pipeline uses them, instead of reaching generate (issue 37)."""
    _, _, hf_dir, _ = checkpoints
    kw = dict(device_map="cpu", revision="main", use_fast=True, trust_remote_code=True)
    loading = {"attn_implementation": "eager", "dtype": "float32"}  # transformers adds to the dict it is given
    theirs = transformers.pipeline("text-generation", model=str(hf_dir), model_kwargs=dict(loading), **kw)
    ours = mf.pipeline("text-generation", model=hf_dir, model_kwargs=dict(loading), **kw)
    assert ours.model.config._attn_implementation == theirs.model.config._attn_implementation == "eager"
    call = dict(max_new_tokens=8, do_sample=False)
    assert _same(_run(ours, PROMPTS, call), _run(theirs, PROMPTS, call))
    with pytest.raises(mf.MindFormersError, match="dtype= both directly and in model_kwargs"):
        mf.pipeline("text-generation", model=hf_dir, dtype="float32", model_kwargs={"dtype": "float32"})
