"""The habits HF users bring, checked against transformers' own model on the same weights (or the third-party
client itself): from_pretrained's loading arguments, output_hidden_states / output_attentions / return_dict,
generate's return_dict_in_generate, peft (LoRA defaults, prompt tuning, AutoPeftModel), transformers' Trainer with
label smoothing, trl's SFT and DPO trainers, packed rows, torch.compile, and generate's fallback when transformers'
private helpers change."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer
from mindformers_py.errors import CheckpointError, ConfigError

TEXTS = ["def main():\n    return 0\n", "hello world, hello there", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny HF Llama with a tokenizer, and the same weights converted to our checkpoint."""
    root = tmp_path_factory.mktemp("hf_habits")
    tokenizer = train_bpe_tokenizer(TEXTS * 10, vocab_size=300, save_dir=root / "hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(root / "hf")
    mf.convert_checkpoint(root / "hf", root / "ours", to="mindformers")
    return root / "hf", root / "ours"


def _hf(folder, **kwargs):
    return transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


def _ids(folder, texts=TEXTS[:2]):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True)


# -- loading ------------------------------------------------------------------------------------------------------


def test_from_pretrained_takes_transformers_loading_arguments(folders, tmp_path):
    hf_dir, ours_dir = folders
    model = mf.AutoModelForCausalLM.from_pretrained(
        ours_dir, torch_dtype="auto", device_map="auto", low_cpu_mem_usage=True, local_files_only=True,
        use_safetensors=True, revision="main", trust_remote_code=True)
    assert model.dtype == torch.float32 and model.hf_device_map == {"": "cpu"}
    assert model.name_or_path == str(ours_dir) and not model.training
    assert mf.AutoModelForCausalLM.from_pretrained(ours_dir, dtype="bfloat16").dtype == torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert mf.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    assert mf.AutoModelForCausalLM.from_pretrained(hf_dir, device_map={"": "cpu"}).device.type == "cpu"
    model, info = mf.AutoModelForSequenceClassification.from_pretrained(ours_dir, num_labels=3, output_loading_info=True)
    assert info["missing_keys"] == {"score.weight"} and info["unexpected_keys"] == {"lm_head.weight"}
    _, theirs = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=3,
                                                                               output_loading_info=True)
    assert info == theirs  # sets of names, as transformers gives them
    assert model.config.num_labels == 3


def test_loading_argument_errors_are_one_line(folders, tmp_path):
    _, ours_dir = folders
    # a typo names the one field meant; a name near nothing lists the fields and the arguments
    with pytest.raises(ConfigError, match=r"^'hidden_sise' is not a GPTConfig field nor a from_pretrained argument; "
                                          r"did you mean 'hidden_size'\?$"):
        mf.AutoModelForCausalLM.from_pretrained(ours_dir, hidden_sise=8)
    with pytest.raises(ConfigError, match=r"'zzzz' is neither a GPTConfig field \(.*hidden_size.*\) nor a "
                                          r"from_pretrained argument \(config, dtype"):
        mf.AutoModelForCausalLM.from_pretrained(ours_dir, zzzz=8)
    with pytest.raises(CheckpointError, match="use_safetensors=False asks for pickled weights"):
        mf.AutoModelForCausalLM.from_pretrained(ours_dir, use_safetensors=False)
    with pytest.raises(ConfigError, match="attn_implementation='flash_attention_9' is not valid; choose one of: 'sdpa'"):
        mf.AutoModelForCausalLM.from_pretrained(ours_dir, attn_implementation="flash_attention_9")
    mf.AutoModelForSequenceClassification.from_pretrained(ours_dir, num_labels=3).save_pretrained(tmp_path / "cls3")
    with pytest.raises(CheckpointError, match="score.weight: checkpoint \\(3, 32\\) vs model \\(5, 32\\).*ignore_mismatched_sizes"):
        mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls3", num_labels=5)
    fresh = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls3", num_labels=5, ignore_mismatched_sizes=True)
    assert fresh.score.weight.shape == (5, 32)


def test_config_object_and_subfolder(folders, tmp_path):
    hf_dir, ours_dir = folders
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = mf.AutoModelForCausalLM.from_pretrained(hf_dir, config=hf_config)
    reference = _hf(hf_dir)
    ids = _ids(hf_dir)
    with torch.no_grad():
        assert (model(**ids).logits - reference(**ids).logits).abs().max() <= 1e-4
    mf.AutoModelForCausalLM.from_pretrained(ours_dir).save_pretrained(tmp_path / "repo" / "sub")
    assert mf.AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub").config.hidden_size == 32


# -- outputs -------------------------------------------------------------------------------------------------------


def _assert_close_tuples(a, b, atol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= atol


@pytest.mark.parametrize("cls", ["AutoModel", "AutoModelForCausalLM"])
def test_hidden_states_attentions_and_tuples_match_transformers(folders, cls):
    hf_dir, _ = folders
    ours = getattr(mf, cls).from_pretrained(hf_dir, attn_implementation="eager")
    reference = getattr(transformers, cls).from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids = _ids(hf_dir)
    with torch.no_grad():
        a = ours(**ids, output_hidden_states=True, output_attentions=True)
        b = reference(**ids, output_hidden_states=True, output_attentions=True)
        keep = ids["attention_mask"].bool()
        assert len(a.hidden_states) == len(b.hidden_states) == 3
        _assert_close_tuples([h[keep] for h in a.hidden_states], [h[keep] for h in b.hidden_states])
        # attention rows of real query tokens (padding rows are arbitrary in both): (tokens, heads, keys)
        _assert_close_tuples([w.permute(0, 2, 1, 3)[keep] for w in a.attentions],
                             [w.permute(0, 2, 1, 3)[keep] for w in b.attentions])
        tup_a, tup_b = ours(**ids, return_dict=False), reference(**ids, return_dict=False)
        assert isinstance(tup_a, tuple) and len(tup_a) == len(tup_b)
        assert (tup_a[0][keep] - tup_b[0][keep]).abs().max() <= 1e-4
        # with SDPA (the default) transformers returns no attention weights; neither do we
        sdpa = getattr(mf, cls).from_pretrained(hf_dir)(**ids, output_attentions=True)
        assert sdpa.attentions is None or all(w is None for w in sdpa.attentions) or sdpa.attentions == ()


def test_sequence_classifier_outputs_hidden_states(folders):
    hf_dir, _ = folders
    ours = mf.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=2)
    out = ours(**_ids(hf_dir), output_hidden_states=True)
    assert len(out.hidden_states) == 3 and out.logits.shape == (2, 2)


def test_generate_returns_hidden_states_and_scores_like_transformers(folders):
    hf_dir, ours_dir = folders
    ours, reference = mf.AutoModelForCausalLM.from_pretrained(ours_dir), _hf(hf_dir)
    ids = _ids(hf_dir)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_hidden_states=True, pad_token_id=0)
    a, b = ours.generate(**ids, **kw), reference.generate(**ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    _assert_close_tuples(a.scores, b.scores)
    assert len(a.hidden_states) == len(b.hidden_states) == 4 and len(a.hidden_states[0]) == 3
    keep = ids["attention_mask"].bool()
    _assert_close_tuples([h[keep] for h in a.hidden_states[0]], [h[keep] for h in b.hidden_states[0]])


# -- peft ------------------------------------------------------------------------------------------------------------


def test_peft_lora_without_target_modules_and_auto_peft_model(folders, tmp_path):
    peft = pytest.importorskip("peft")
    _, ours_dir = folders
    model = peft.get_peft_model(mf.AutoModelForCausalLM.from_pretrained(ours_dir), peft.LoraConfig(r=4, task_type="CAUSAL_LM"))
    targets = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert targets == {"q_proj", "v_proj"}  # Llama's defaults
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(ours_dir)
    back = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert isinstance(back.base_model.model, mf.GPTForCausalLM)


def test_peft_prompt_tuning_generates_with_its_virtual_tokens(folders):
    peft = pytest.importorskip("peft")
    hf_dir, ours_dir = folders
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    ours = peft.get_peft_model(mf.AutoModelForCausalLM.from_pretrained(ours_dir), config)
    reference = peft.get_peft_model(_hf(hf_dir), config)
    with torch.no_grad():
        prompt = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        ours.prompt_encoder["default"].embedding.weight.copy_(prompt)
        reference.prompt_encoder["default"].embedding.weight.copy_(prompt)
    ids = _ids(hf_dir, TEXTS[1:2])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    tuned = ours.generate(**ids, **kw)
    assert torch.equal(tuned, reference.generate(**ids, **kw))
    assert not torch.equal(tuned, mf.AutoModelForCausalLM.from_pretrained(ours_dir).generate(**ids, **kw))


# -- transformers' Trainer and trl --------------------------------------------------------------------------------------


def _token_rows(folder, n=8):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([TEXTS[i % 3] for i in range(n)], truncation=True, max_length=16, padding="max_length")
    return [{"input_ids": ids, "attention_mask": m, "labels": [t if k else -100 for t, k in zip(ids, m)]}
            for ids, m in zip(enc["input_ids"], enc["attention_mask"])]


def _hf_trainer_losses(model, rows, folder):
    args = transformers.TrainingArguments(output_dir=str(folder), max_steps=2, per_device_train_batch_size=4,
                                          label_smoothing_factor=0.1, logging_steps=1, report_to=[], use_cpu=True,
                                          learning_rate=1e-3, disable_tqdm=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_transformers_trainer_label_smoothing_shifts_our_labels(folders, tmp_path):
    hf_dir, ours_dir = folders
    rows = _token_rows(hf_dir)
    ours = _hf_trainer_losses(mf.AutoModelForCausalLM.from_pretrained(ours_dir).train(), rows, tmp_path / "ours")
    reference = _hf_trainer_losses(_hf(hf_dir).train(), rows, tmp_path / "hf")
    assert len(ours) == 2 and ours == pytest.approx(reference, rel=1e-4)


def test_trl_sft_trainer_takes_our_checkpoint_folder(folders, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    _, ours_dir = folders
    trainer = trl.SFTTrainer(
        model=str(ours_dir), train_dataset=Dataset.from_dict({"text": TEXTS * 4}),
        args=trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4, report_to=[],
                           use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True))
    trainer.train()
    assert isinstance(trainer.model, mf.GPTForCausalLM)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_trl_dpo_trainer_makes_its_reference_model_from_ours(folders, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    _, ours_dir = folders
    data = Dataset.from_dict({"prompt": ["def main():"] * 4, "chosen": [" return 0"] * 4, "rejected": [" pass"] * 4})
    trainer = trl.DPOTrainer(
        model=mf.AutoModelForCausalLM.from_pretrained(ours_dir), train_dataset=data,
        processing_class=transformers.AutoTokenizer.from_pretrained(ours_dir),
        args=trl.DPOConfig(output_dir=str(tmp_path / "dpo"), max_steps=1, per_device_train_batch_size=2, report_to=[],
                           use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True))
    trainer.train()
    assert trainer.state.global_step == 1


# -- packed rows, torch.compile, generate's fallback -------------------------------------------------------------------


def test_padding_free_packed_rows_match_transformers(folders):
    hf_dir, ours_dir = folders
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    features = [{"input_ids": tok(t)["input_ids"]} for t in TEXTS] * 8  # 3 × 8 sequences: longer than the context
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    assert batch["input_ids"].shape[1] > 64 and int(batch["position_ids"].max()) < 64
    ours, reference = mf.AutoModelForCausalLM.from_pretrained(ours_dir), _hf(hf_dir)
    # transformers' SDPA path finds packed rows only without a cache object (use_cache=False; its flash-attention
    # path always does); ours whenever nothing is cached yet, so the defaults already keep sequences apart.
    with torch.no_grad():
        a, b = ours(**batch), reference(**batch, use_cache=False)
    assert abs(a.loss - b.loss) <= 1e-4 and (a.logits - b.logits).abs().max() <= 1e-4
    separate = ours(torch.tensor([features[1]["input_ids"]])).logits[0]
    start = len(features[0]["input_ids"])
    assert (a.logits[0, start:start + separate.shape[0]] - separate).abs().max() <= 1e-4


def test_torch_compile_fullgraph_with_an_attention_mask(folders):
    _, ours_dir = folders
    model = mf.AutoModelForCausalLM.from_pretrained(ours_dir)
    ids = _ids(ours_dir)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # graph capture only: no graph break allowed
    with torch.no_grad():
        torch.testing.assert_close(compiled(**ids).logits, model(**ids).logits)


def test_generate_falls_back_when_transformers_private_helpers_change(folders, monkeypatch, caplog):
    """A release that changes a private generation helper (here: its signature, with transformers' own caller
    updated) must not break generate: the lean loop steps aside and GenerationMixin's loop gives the same tokens."""
    import inspect

    from mindformers_py.generation import fast_generate

    hf_dir, ours_dir = folders
    ours, reference = mf.AutoModelForCausalLM.from_pretrained(ours_dir), _hf(hf_dir)
    ids = _ids(hf_dir)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = reference.generate(**ids, **kw)
    original = transformers.GenerationMixin._get_logits_processor

    def changed(self, *args, **kwargs):
        if inspect.currentframe().f_back.f_globals["__name__"] == fast_generate.__name__:
            raise TypeError("_get_logits_processor() got an unexpected keyword argument 'input_ids_seq_length'")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "_get_logits_processor", changed)
    monkeypatch.setattr(fast_generate, "_drift_reported", False)
    with caplog.at_level("WARNING"):
        assert torch.equal(ours.generate(**ids, **kw), expected)
    assert "generate runs GenerationMixin's loop" in caplog.text


def test_pipeline_of_a_loaded_model_object_finds_its_tokenizer(folders):
    _, ours_dir = folders
    pipe = mf.pipeline("text-generation", model=mf.AutoModelForCausalLM.from_pretrained(ours_dir))
    assert pipe("def main", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("def main")


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cache_argument_under_both_transformers_names(folders, name):
    """transformers 5.24 passes the key/value cache as ``cache=`` (earlier releases, and most user code, as
    ``past_key_values=``): under either name a forward continues from the cache, and GenerationMixin's own loop
    on our model gives transformers' logits at every step."""
    from mindformers_py.models.cache_names import output_cache

    hf_dir, ours_dir = folders
    ours, reference = mf.AutoModelForCausalLM.from_pretrained(ours_dir).eval(), _hf(hf_dir)
    ids = _ids(hf_dir)["input_ids"][:1]
    with torch.no_grad():
        whole = ours(ids).logits[:, -1]
        prefix = ours(ids[:, :-1], use_cache=True)
        cache = output_cache(prefix)  # the output field has the installed transformers' name
        step = ours(ids[:, -1:], **{name: cache}).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)
    kw = dict(max_new_tokens=5, do_sample=False, repetition_penalty=1.5, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    inputs = _ids(hf_dir)
    a, b = ours.generate(**inputs, fast_generate=False, **kw), reference.generate(**inputs, **kw)
    assert torch.equal(a.sequences, b.sequences)
    _assert_close_tuples(a.logits, b.logits)


def test_cache_given_under_both_names_is_refused(folders):
    from transformers import DynamicCache

    from mindformers_py.errors import MindFormersError

    ours = mf.AutoModelForCausalLM.from_pretrained(folders[1])
    with pytest.raises(MindFormersError, match="not both"):
        ours(torch.tensor([[5, 6]]), cache=DynamicCache(), past_key_values=DynamicCache())
