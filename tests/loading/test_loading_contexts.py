"""Loading works wherever a script loads: inside ``torch.inference_mode()`` (inference scripts wrap everything in
it), ``torch.no_grad()``, a thread, after ``torch.set_default_dtype`` and under a default device; through every
route to ``from_pretrained`` (our Auto classes, a model class of ours on an HF checkpoint and on our own,
transformers' Auto classes on our checkpoint, a preset, ``pipeline``). The loaded model is the one a plain load
gives (same logits, ordinary tensors that can still be trained), and decodes under ``inference_mode`` in every
family that generates."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import transformers
from families import FAMILIES, first_output

import mindformers_py as mf


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's HF checkpoint, and the GPT one saved again by us (our own format)."""
    found = {}
    for name, family in FAMILIES.items():
        found[name] = tmp_path_factory.mktemp(name)
        family.save(found[name])
    found["gpt_ours"] = tmp_path_factory.mktemp("gpt_ours")
    mf.AutoModelForCausalLM.from_pretrained(found["gpt"]).save_pretrained(found["gpt_ours"])
    return found


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def default_device(device):
    before = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(before)


CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "default_dtype_float64": lambda: default_dtype(torch.float64),
    "default_device_cpu": lambda: default_device("cpu"),
    "device_block_cpu": lambda: torch.device("cpu"),
}

ROUTES = {
    "our_auto_class": lambda f: mf.AutoModelForCausalLM.from_pretrained(f["gpt"]),
    "our_model_class_on_hf_checkpoint": lambda f: mf.GPTForCausalLM.from_pretrained(f["gpt"]),
    "our_model_class_on_our_checkpoint": lambda f: mf.GPTForCausalLM.from_pretrained(f["gpt_ours"]),
    "transformers_auto_class_on_our_checkpoint": lambda f: transformers.AutoModelForCausalLM.from_pretrained(
        f["gpt_ours"]),
    "pipeline": lambda f: mf.pipeline("feature-extraction", model=f["gpt_ours"],
                                      tokenizer=_tokenizer(f["gpt_ours"])).model,
}


def _tokenizer(folder):
    from mindformers_py.data import train_bpe_tokenizer

    return train_bpe_tokenizer(["def f(x):\n    return x\n" * 20], 300)


def _in_a_thread(load):
    result = {}

    def run():
        try:
            result["model"] = load()
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["model"]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("context", [*CONTEXTS, "thread"])
def test_every_route_loads_in_every_context(folders, route, context):
    ids = FAMILIES["gpt"].inputs()["input_ids"]
    plain = mf.AutoModelForCausalLM.from_pretrained(folders["gpt"])
    load = lambda: ROUTES[route](folders)  # noqa: E731
    if context == "thread":
        model = _in_a_thread(load)
    else:
        with CONTEXTS[context]():
            model = load()
    params = list(model.parameters())
    assert not any(p.is_inference() or p.is_meta for p in params), "ordinary tensors with values"
    assert {p.dtype for p in params} == {torch.float32} and {p.device.type for p in params} == {"cpu"}
    with torch.no_grad():
        base = model.base_model if route == "pipeline" else model
        out = base(ids)
        expected = plain(ids) if route != "pipeline" else plain.model(ids)
        assert torch.equal(first_output(out), first_output(expected)) or \
            torch.equal(out.last_hidden_state, expected.last_hidden_state)
    if route != "pipeline":  # still a model that trains
        model.train()
        model(ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in params if p.requires_grad)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_loads_and_runs_under_inference_mode(folders, name):
    family = FAMILIES[name]
    inputs = family.inputs()
    with torch.no_grad():
        expected = first_output(family.ours.from_pretrained(folders[name])(**inputs))
    with torch.inference_mode():
        model = family.ours.from_pretrained(folders[name])
        assert torch.equal(first_output(model(**inputs)), expected)
        if family.generates:
            prompt = inputs["input_ids"][:1]
            hf = family.hf_auto.from_pretrained(folders[name]).eval()
            kwargs = dict(max_new_tokens=4, do_sample=False, min_new_tokens=4)
            assert torch.equal(model.generate(prompt, **kwargs), hf.generate(prompt, **kwargs))


def test_a_preset_and_from_config_in_inference_mode_and_under_float64():
    for context in (torch.inference_mode, lambda: default_dtype(torch.float64)):
        with context():
            torch.manual_seed(0)
            preset = mf.AutoModelForCausalLM.from_pretrained("llama_tiny", num_hidden_layers=1, hidden_size=32,
                                                            num_attention_heads=2, num_key_value_heads=1)
            built = mf.AutoModelForCausalLM.from_config(preset.config)
        for model in (preset, built):
            assert not any(p.is_inference() for p in model.parameters())
            assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_from_pretrained_on_a_meta_default_device_is_one_line(folders):
    with default_device("meta"), pytest.raises(mf.MindFormersError, match="a meta device .* cannot hold"):
        mf.AutoModelForCausalLM.from_pretrained(folders["gpt"])


ONE_ROUTE = [route for route in ROUTES if route != "pipeline"]


def test_every_route_defers_and_takes_dtype_alike(folders):
    """Model classes and Auto classes (ours and transformers') load a folder by one route: under
    ``deferred_loading()`` each returns its parameters still on ``meta`` for a layout to fill, and ``dtype`` gives
    the same tensors whichever class was called (our model class on our own folder went to transformers' loader,
    which ignored ``deferred_loading()``)."""
    from mindformers_py.loading import deferred_loading

    for route in ONE_ROUTE:
        with deferred_loading():
            model = ROUTES[route](folders)
        assert all(p.is_meta for p in model.parameters()), route
    reference = mf.AutoModelForCausalLM.from_pretrained(folders["gpt_ours"], dtype=torch.bfloat16).state_dict()
    for load in (mf.GPTForCausalLM, transformers.AutoModelForCausalLM):
        state = load.from_pretrained(folders["gpt_ours"], dtype=torch.bfloat16).state_dict()
        assert state.keys() == reference.keys()
        assert all(state[k].dtype == reference[k].dtype and torch.equal(state[k], reference[k]) for k in state), load
