"""The decode step a CUDA graph captures (``generation/graphed_step.py``), checked on the CPU: run uncaptured it gives
transformers' tokens (the whole cache under a key mask, written at a slot tensor, left-padded rows included), its
compiled code serves every step and a second request of the same bucket without recompiling, a failed capture falls
back to the uncaptured step, and the graph is chosen only on CUDA for a compiled static-cache request."""

import contextlib

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

import mindformers_py as mf
from mindformers_py.generation import fast_generate, graphed_step
from mindformers_py.generation.compiled_step import graph_compile_options
from support.hf_models import VOCAB, tiny_hf_model

CAPTURE_ONLY = CompileConfig(backend="eager")


@pytest.fixture(params=["llama", "gpt2"])
def models(request, tmp_path):
    hf = tiny_hf_model(request.param).eval()
    hf.save_pretrained(tmp_path)
    return hf, mf.AutoModelForCausalLM.from_pretrained(tmp_path)


def prompts():
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # a left-padded row
    return ids, mask


@pytest.fixture
def fixed_shapes_on_cpu(monkeypatch):
    """Every lean decode takes the fixed-shape step, uncaptured (what a CUDA graph would replay)."""
    monkeypatch.setattr(fast_generate, "wants_cuda_graph", lambda model, config, device: True)
    built = []

    def uncaptured(*args):
        step = graphed_step.StaticShapeStep(*args[:-1], capture=False)
        built.append(step)
        return step

    monkeypatch.setattr(fast_generate, "StaticShapeStep", uncaptured)
    return built


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fixed_shape_step_gives_transformers_tokens(models, fixed_shapes_on_cpu, compiled):
    hf, ours = models
    ids, mask = prompts()
    kw = dict(max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    options = dict(compile_config=CAPTURE_ONLY) if compiled else dict(disable_compile=True)
    out = ours.generate(ids, attention_mask=mask, cache_implementation="static", **options, **kw)
    assert torch.equal(out, hf.generate(ids, attention_mask=mask, **kw))
    step = fixed_shapes_on_cpu[0]
    assert step.mask.shape[-1] == graphed_step.CAPACITY_STEP  # the whole (rounded) cache, masked
    assert step.mask[1, 0, 0, :2].tolist() == [False, False] and bool(step.mask[:, 0, 0, 6:6 + 8].all())
    assert not bool(step.mask[:, 0, 0, 6 + 8:].any())  # nothing beyond the last token written


def test_the_compiled_fixed_shape_step_is_compiled_once_for_every_step_and_request(models, fixed_shapes_on_cpu):
    _, ours = models
    ids, mask = prompts()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static",
              compile_config=CAPTURE_ONLY)
    first = ours.generate(ids, attention_mask=mask, max_new_tokens=9, **kw)
    with torch.compiler.set_stance("fail_on_recompile"):  # another length in the same bucket, another prompt
        ours.generate(ids[:, 1:], attention_mask=mask[:, 1:], max_new_tokens=12, **kw)
        assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=9, **kw), first)


def test_a_failed_capture_runs_the_step_uncaptured(models, monkeypatch, caplog):
    hf, ours = models
    monkeypatch.setattr(fast_generate, "wants_cuda_graph", lambda model, config, device: True)
    monkeypatch.setattr(graphed_step, "_capture_failure_reported", False)

    class FakeStream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def failing_capture(graph):
        yield
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    ids, mask = prompts()
    kw = dict(max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    with caplog.at_level("WARNING"):
        out = ours.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=CAPTURE_ONLY, **kw)
    assert torch.equal(out, hf.generate(ids, attention_mask=mask, **kw))
    assert "could not be captured in a CUDA graph" in caplog.text


def test_the_graph_is_chosen_only_for_a_compiled_static_step_on_cuda(models):
    _, ours = models
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    static = GenerationConfig(cache_implementation="static")
    assert graphed_step.wants_cuda_graph(ours, static, cuda)
    assert not graphed_step.wants_cuda_graph(ours, static, cpu)
    assert not graphed_step.wants_cuda_graph(ours, GenerationConfig(), cuda)
    assert not graphed_step.wants_cuda_graph(ours, GenerationConfig(cache_implementation="static", disable_compile=True),
                                             cuda)
    ours.cuda_graph_decode = False
    assert not graphed_step.wants_cuda_graph(ours, static, cuda)


def test_no_graph_for_sliding_windows_experts_dynamic_rope_or_encoder_decoders():
    static, cuda = GenerationConfig(cache_implementation="static"), torch.device("cuda")
    small = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    windowed = mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", sliding_window=8, **small))
    assert not graphed_step.wants_cuda_graph(windowed, static, cuda)
    assert graphed_step.wants_cuda_graph(mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", **small)), static, cuda)
    routed = mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", moe_config=dict(expert_num=2), **small))
    assert not graphed_step.wants_cuda_graph(routed, static, cuda)
    dynamic = mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, **small))
    assert not graphed_step.wants_cuda_graph(dynamic, static, cuda)
    t5 = mf.AutoModelForSeq2SeqLM.from_config(mf.AutoConfig.from_pretrained("t5_tiny", vocab_size=32))
    assert not graphed_step.wants_cuda_graph(t5, static, cuda)


def test_no_cuda_graph_is_made_on_the_cpu(models, monkeypatch):
    hf, ours = models

    def refuse():
        raise AssertionError("a CUDA graph on the CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    ids, mask = prompts()
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = ours.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=CAPTURE_ONLY, **kw)
    assert torch.equal(out, hf.generate(ids, attention_mask=mask, **kw))


@pytest.mark.parametrize("mode, expected", [("reduce-overhead", None), ("default", None), (None, None),
                                            ("max-autotune", "max-autotune-no-cudagraphs")])
def test_a_captured_step_is_compiled_for_static_shapes_without_inductors_own_graphs(mode, expected):
    options = graph_compile_options({"backend": "inductor", "dynamic": True, "fullgraph": False, "mode": mode})
    assert options["dynamic"] is False and options["mode"] == expected
    tuned = graph_compile_options({"backend": "inductor", "dynamic": None, "options": {"max_autotune": True}})
    assert tuned["options"] == {"max_autotune": True, "triton.cudagraphs": False}
