"""transformers' model contract on our classes (issue 18): models built from HF configs, every general config
setting carried over, the causal-LM loss with ``shift_labels``, rotary models past ``max_position_embeddings``, the
config names and tensor-parallel plans a model of each flavour answers. Each is checked against transformers' own
model (or config) on the same weights, in fp32."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import mindformers_py as mf
from support.hf_models import tiny_hf_config, tiny_hf_model
from support.tolerances import SAME_WEIGHTS_ANOTHER_PATH
from mindformers_py.errors import ConfigError
from mindformers_py.models.cache_names import output_cache
from mindformers_py.models.gpt import convert_gpt


def _ours_from(hf_model, cls=None):
    """Our model built from the HF model's config object, holding its weights."""
    ours = (cls or mf.GPTForCausalLM)(hf_model.config).eval()
    ours.load_state_dict(convert_gpt.state_dict_from_hf(hf_model.state_dict(), ours.config))
    return ours


# -- 1. models built from HF configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_models_are_built_from_transformers_configs(kind):
    hf = tiny_hf_model(kind)
    ours = _ours_from(hf)
    assert isinstance(ours.config, mf.GPTConfig) and ours.model.config is ours.config
    assert ours.config.hf_architecture == kind
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    random = mf.AutoModelForCausalLM.from_config(tiny_hf_config(kind))
    assert isinstance(random, mf.GPTForCausalLM) and random.config.num_hidden_layers == 2
    assert isinstance(mf.AutoModel.from_config(tiny_hf_config(kind)), mf.GPTModel)
    with pytest.raises(ConfigError, match="BertConfig .*cannot build this model; pass a GPTConfig or transformers' gpt2"):
        mf.GPTModel(transformers.BertConfig())


def _converted_architectures():
    """A tiny transformers config of every architecture a family converts, and the input its base model takes."""
    from support.bert_models import tiny_bert_config
    from support.t5_models import tiny_hf_config as tiny_t5_config

    ids = torch.randint(3, 100, (2, 7))
    text, seq2seq = {"input_ids": ids}, {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
                                 image_size=8, patch_size=4)
    return {**{kind: (tiny_hf_config(kind), text) for kind in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral",
                                                               "qwen2_moe", "qwen3_moe")},
            "bert": (tiny_bert_config("bert"), text), "roberta": (tiny_bert_config("roberta"), text),
            "t5": (tiny_t5_config("t5"), seq2seq), "mt5": (tiny_t5_config("mt5"), seq2seq),
            "vit": (vit, {"pixel_values": torch.randn(2, 3, 8, 8)})}


def test_every_converted_architecture_builds_from_its_transformers_config():
    for kind, (config, inputs) in _converted_architectures().items():
        ours = mf.AutoModel.from_config(config).eval()
        assert ours.config.model_type.startswith("mindformers_"), kind
        assert type(ours)(config).config.to_dict() == ours.config.to_dict(), kind  # the constructor takes it too
        length = {"pixel_values": 5, "decoder_input_ids": 4}.get(list(inputs)[-1], 7)  # ViT: 4 patches and [CLS]
        with torch.no_grad():
            assert ours(**inputs).last_hidden_state.shape == (2, length, 32), kind


# -- 2. the general config settings ------------------------------------------------------------------------------------

GENERAL_VALUES = dict(
    return_dict=False, output_hidden_states=True, use_cache=False, chunk_size_feed_forward=3,
    id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2},
    problem_type="single_label_classification", finetuning_task="sst2", tokenizer_class="PreTrainedTokenizerFast",
    prefix="say: ", task_specific_params={"summarization": {"num_beams": 2}}, bos_token_id=1, pad_token_id=0,
    eos_token_id=2, sep_token_id=3, decoder_start_token_id=4, tie_word_embeddings=False, is_decoder=True,
    add_cross_attention=False, tie_encoder_decoder=False, dtype=torch.bfloat16,
)


def _hf_configs():
    from support.bert_models import tiny_bert_config
    from support.t5_models import tiny_hf_config as tiny_t5_config

    return {"llama": tiny_hf_config("llama"), "gpt2": tiny_hf_config("gpt2"), "bert": tiny_bert_config("bert"),
            "t5": tiny_t5_config("t5"), "vit": transformers.ViTConfig(hidden_size=32, num_hidden_layers=1,
                                                                          num_attention_heads=4, image_size=8, patch_size=4)}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "t5", "vit"])
def test_every_general_config_setting_survives_a_round_trip(kind, tmp_path):
    from mindformers_py.models import hf_config

    hf = _hf_configs()[kind]
    for name, value in GENERAL_VALUES.items():
        setattr(hf, name, value)
    hf.output_attentions = True  # sets the eager implementation, as in transformers
    hf.save_pretrained(tmp_path)
    family = mf.models.registry.family_for_model_type(hf.model_type)
    for ours in (mf.AutoConfig.from_pretrained(tmp_path), hf_config.own_config(family.config_class, hf)):
        back = family.converter.config_to_hf(ours)
        for name in (*GENERAL_VALUES, "output_attentions"):
            expected = getattr(hf, name)
            assert getattr(ours, name) == expected, name
            assert getattr(back, name) == expected, name
    assert hf_config.own_config(family.config_class, hf)._attn_implementation == "eager"


def test_general_settings_reach_the_model(tmp_path):
    hf = tiny_hf_model("gpt2")
    hf.save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(3, 128, (1, 5))
    config = transformers.GPT2Config.from_pretrained(tmp_path / "gpt2", output_hidden_states=True)
    out = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", config=config)(ids)
    assert out.hidden_states is not None and len(out.hidden_states) == 3
    saved = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**saved, "output_hidden_states": True,
                                                               "gradient_checkpointing": True}))
    model = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert len(model(ids).hidden_states) == 3
    assert model.is_gradient_checkpointing and transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "gpt2").is_gradient_checkpointing
    from support.t5_models import tiny_hf_config as tiny_t5_config

    encoder = mf.T5EncoderModel(tiny_t5_config("t5"))
    reference = transformers.T5EncoderModel(tiny_t5_config("t5"))
    assert encoder.config.is_encoder_decoder is reference.config.is_encoder_decoder is False
    assert encoder.config.use_cache is reference.config.use_cache is False


def test_a_transformers_config_loads_our_checkpoint_and_mismatched_sizes_raise_runtime_error(tmp_path):
    """``from_pretrained(folder, config=<HF config>)`` reads the folder's weights as its own ``config.json`` says
    (ours or HF's); a shape that does not fit is transformers' RuntimeError (ours is also a CheckpointError)."""
    hf = tiny_hf_model("gpt2", "sequence_classification")
    hf.save_pretrained(tmp_path / "hf")
    mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    config, ids = tiny_hf_config("gpt2"), torch.randint(3, 128, (2, 5))
    config.num_labels = hf.config.num_labels
    with torch.no_grad():
        for folder in ("hf", "ours"):
            ours = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / folder, config=config)
            assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    config.vocab_size = 10
    for folder in ("hf", "ours"):
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes=True"):
            mf.AutoModel.from_pretrained(tmp_path / folder, config=config)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModel.from_pretrained(tmp_path / "hf", config=config)
    resized = mf.AutoModel.from_pretrained(tmp_path / "ours", config=config, ignore_mismatched_sizes=True)
    assert resized.get_input_embeddings().weight.shape == (10, 32)


# -- 3. the causal-LM loss with shift_labels ---------------------------------------------------------------------------


def test_causal_lm_loss_takes_shift_labels_as_transformers():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from mindformers_py.layers import causal_lm_loss

    hf = tiny_hf_model("llama")
    ours = _ours_from(hf)
    ids = torch.randint(3, 128, (2, 9))
    shifted = torch.randint(3, 128, (2, 9))
    shifted[0, :4] = -100
    with torch.no_grad():
        for kwargs in ({}, {"shift_labels": shifted}, {"shift_labels": shifted, "num_items_in_batch": 11}):
            a, b = ours(ids, labels=ids, **kwargs).loss, hf(ids, labels=ids, **kwargs).loss
            assert abs(a - b) <= 1e-5, kwargs
        assert ours(ids, labels=ids).loss != ours(ids, labels=ids, shift_labels=shifted).loss
        logits = torch.randn(2, 9, 128)
        for kwargs in ({}, {"shift_labels": shifted, "num_items_in_batch": torch.tensor(7)}):
            assert torch.allclose(causal_lm_loss(logits, ids, 128, **kwargs), ForCausalLMLoss(logits, ids, 128, **kwargs))
    batch = {"labels": ids, "shift_labels": shifted}
    assert mf.task_registry.get_task("causal_lm").count_items(batch) == int((shifted != -100).sum())


# -- 4. rotary positions past max_position_embeddings ------------------------------------------------------------------


def test_rotary_models_run_past_max_position_embeddings():
    hf = tiny_hf_model("llama")  # max_position_embeddings = 64
    ours = _ours_from(hf)
    ids = torch.randint(3, 128, (1, 80))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:, :60], **kw), hf.generate(ids[:, :60], **kw))
    learned = _ours_from(tiny_hf_model("gpt2"))
    with pytest.raises(mf.MindFormersError, match="exceeds the context length max_position_embeddings=64"):
        learned(ids)


@pytest.mark.parametrize("rope", [dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
                                  dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4,
                                       long_factor=[2.0, 3.0, 4.0, 5.0], original_max_position_embeddings=16)])
def test_rope_rescaling_past_the_trained_length_matches_transformers(rope):
    config = tiny_hf_config("llama")  # head_dim 8: four frequencies
    config.rope_parameters = rope
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = _ours_from(hf)
    with torch.no_grad():
        for length in (10, 100, 10):  # within, past (rescaled), and back within (reset) the trained length
            ids = torch.randint(3, 128, (1, length))
            assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4, length


# -- 9. config names, 10. tensor-parallel plans ------------------------------------------------------------------------


def test_each_flavour_answers_its_transformers_names():
    gpt2 = mf.GPTForCausalLM(tiny_hf_config("gpt2")).config
    reference = tiny_hf_config("gpt2")
    for name in ("n_layer", "n_embd", "n_head", "n_positions", "layer_norm_epsilon", "activation_function"):
        assert getattr(gpt2, name) == getattr(reference, name), name
    gpt2.n_layer = 3
    assert gpt2.num_hidden_layers == 3 and "n_layer" not in gpt2.to_dict()
    llama = mf.GPTConfig(flavour="llama", rms_norm_eps=1e-5)
    assert llama.norm_eps == llama.rms_norm_eps == 1e-5 and not hasattr(llama, "n_layer")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_plans_name_only_modules_that_exist(kind):
    import re

    model = mf.GPTModel(tiny_hf_config(kind))
    names = [name for name, _ in model.named_modules()]
    plan = model.config.base_model_tp_plan
    for pattern in plan:
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        assert any(regex.match(name) for name in names), pattern
    assert set(plan) <= set(mf.GPTConfig.base_model_tp_plan)
    assert any("shared_expert" in p for p in plan) == (kind == "qwen2_moe")
    assert any(p.endswith("q_norm") for p in plan) == kind.startswith("qwen3")
    assert any(p.endswith("kv_b_proj") for p in plan) == (kind == "deepseek_v3") != any(p.endswith("k_proj") for p in plan)


# -- 5. configs transformers runs: Mixtral's router jitter, GPT-2's attention options ----------------------------------


def test_mixtral_router_jitter_noise_matches_transformers_in_training():
    hf = tiny_hf_model("mixtral", router_jitter_noise=0.1)
    ours = _ours_from(hf)
    assert ours.config.moe.router_jitter_noise == 0.1
    assert mf.models.gpt.convert_gpt.config_to_hf(ours.config).router_jitter_noise == 0.1
    ids = torch.randint(3, 128, (2, 9))
    hf.train(), ours.train()
    torch.manual_seed(3)
    jittered = ours(ids).logits
    torch.manual_seed(3)
    assert (jittered - hf(ids).logits).abs().max() <= 1e-4  # the same noise, drawn at the same place
    hf.eval(), ours.eval()
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4  # no noise in evaluation
        assert (ours(ids).logits - jittered).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_moe"])
def test_qwen_models_mixing_sliding_and_full_attention_layers(kind):
    """Found by transformers' common tests (test_sliding_window_mask): these configs were refused."""
    fields = {**tiny_hf_config(kind).to_dict(), "use_sliding_window": True, "sliding_window": 3,
              "max_window_layers": 1 if kind == "qwen2" else 3}
    config = type(tiny_hf_config(kind))(**{k: v for k, v in fields.items() if k not in ("layer_types", "model_type")})
    assert len(set(config.layer_types)) == 2
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    ours = _ours_from(hf)
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-4
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
    kw["cache_implementation"] = "static"  # one ready mask per attention kind, from transformers' generation
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
    back = mf.models.gpt.convert_gpt.config_to_hf(ours.config)
    assert back.layer_types == config.layer_types and back.sliding_window == 3


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("options", [dict(scale_attn_by_inverse_layer_idx=True), dict(reorder_and_upcast_attn=True),
                                     dict(scale_attn_weights=False, reorder_and_upcast_attn=True)])
def test_gpt2_attention_options_are_layer_options(options, impl):
    hf = tiny_hf_model("gpt2", **options)
    hf.config._attn_implementation = impl
    ours = _ours_from(hf)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4
        if impl == "eager" and options.get("reorder_and_upcast_attn"):  # the fp32 scores show under bf16
            a, b = ours.to(torch.bfloat16)(ids).logits.float(), hf.to(torch.bfloat16)(ids).logits.float()
            assert (a - b).abs().max() <= 2e-2
    back = mf.models.gpt.convert_gpt.config_to_hf(ours.config)
    assert all(getattr(back, k) == v for k, v in options.items())


# -- 6. BERT as a decoder ----------------------------------------------------------------------------------------------


def _bert_pair(hf_model):
    """Our model of the same class name built from the HF model's config, holding its weights."""
    from mindformers_py.models.bert import convert_bert

    ours = mf.BertLMHeadModel(hf_model.config).eval()
    assert not ours.load_state_dict(convert_bert.state_dict_from_hf(hf_model.state_dict(), ours.config),
                                    strict=False).missing_keys
    return ours


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_bert_lm_head_model_generates_as_transformers(kind):
    from support.bert_models import tiny_bert_config

    torch.manual_seed(1)
    cls = transformers.BertLMHeadModel if kind == "bert" else transformers.RobertaForCausalLM
    hf = cls(tiny_bert_config(kind, is_decoder=True)).eval()
    ours = _bert_pair(hf)
    ids = torch.randint(5, 128, (2, 9))
    with torch.no_grad():
        a, b = ours(ids, labels=ids), hf(ids, labels=ids)
        assert (a.logits - b.logits).abs().max() <= 1e-4 and abs(a.loss - b.loss) <= 1e-5
    for kw in (dict(max_new_tokens=6, do_sample=False), dict(max_new_tokens=4, do_sample=False, num_beams=2)):
        assert torch.equal(ours.generate(ids[:, :4], pad_token_id=0, **kw), hf.generate(ids[:, :4], pad_token_id=0, **kw))


def test_bert_to_bert_encoder_decoder_runs_on_our_layers(tmp_path):
    from support.bert_models import tiny_bert_config
    from mindformers_py.models.bert import convert_bert

    torch.manual_seed(0)
    decoder_config = tiny_bert_config("bert", is_decoder=True, add_cross_attention=True)
    hf = transformers.EncoderDecoderModel(encoder=transformers.BertModel(tiny_bert_config("bert")),
                                          decoder=transformers.BertLMHeadModel(decoder_config)).eval()
    encoder = mf.BertModel(hf.encoder.config)
    state = convert_bert.state_dict_from_hf(hf.encoder.state_dict(), encoder.config)
    encoder.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    ours = transformers.EncoderDecoderModel(encoder=encoder, decoder=_bert_pair(hf.decoder)).eval()
    for model in (hf, ours):
        model.config.decoder_start_token_id, model.config.pad_token_id = 2, 0
    source, target = torch.randint(5, 128, (2, 7)), torch.randint(5, 128, (2, 5))
    mask = torch.ones_like(source)
    mask[1, 5:] = 0
    with torch.no_grad():
        a, b = ours(input_ids=source, attention_mask=mask, labels=target), hf(input_ids=source, attention_mask=mask, labels=target)
        assert (a.logits - b.logits).abs().max() <= 1e-4 and abs(a.loss - b.loss) <= 1e-5
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, decoder_start_token_id=2, pad_token_id=0, num_beams=2)
    assert torch.equal(ours.generate(source, **kw), hf.generate(source, **kw))
    encoder.save_pretrained(tmp_path / "bert")  # transformers builds BERT-to-BERT from our checkpoints too
    pair = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "bert", tmp_path / "bert")
    assert isinstance(pair.decoder, mf.BertLMHeadModel) and pair.decoder.config.add_cross_attention


def test_gpt2_cross_attention_as_transformers(tmp_path):
    """GPT-2 with add_cross_attention (the decoder of a BERT-to-GPT-2 encoder-decoder) was refused."""
    torch.manual_seed(0)
    config = tiny_hf_config("gpt2")
    config.add_cross_attention = True
    hf = _randomised(transformers.GPT2LMHeadModel(config), tmp_path / "hf")
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids, encoded = torch.randint(3, 128, (2, 7)), torch.randn(2, 5, 32)
    encoder_mask = torch.ones(2, 5, dtype=torch.long)
    encoder_mask[1, 3:] = 0
    kw = dict(encoder_hidden_states=encoded, encoder_attention_mask=encoder_mask)
    back = _round_trip(tmp_path / "hf", transformers.GPT2LMHeadModel)
    with torch.no_grad():
        a, b = ours(ids, **kw).logits, hf(ids, **kw).logits
        assert (a - b).abs().max() <= 1e-4
        torch.testing.assert_close(back(ids, **kw).logits, b, **SAME_WEIGHTS_ANOTHER_PATH)
        step = ours(ids[:, :-1], use_cache=True, **kw)  # the cache keeps the cross-attention keys too
        last = ours(ids[:, -1:], past_key_values=output_cache(step), **kw).logits[:, -1]
        assert (last - b[:, -1]).abs().max() <= 1e-4


# -- 7. the missing heads, loaded and exported ---------------------------------------------------------------------------


def _randomised(model, folder):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model.eval()


def _round_trip(folder, reference_class):
    """transformers' model of the checkpoint exported back to HF after a conversion to ours; its weights are exactly
    the original's (its outputs then agree within :data:`SAME_WEIGHTS_ANOTHER_PATH`)."""
    mf.convert_checkpoint(folder, folder.with_name(folder.name + "_ours"), to="mindformers")
    mf.convert_checkpoint(folder.with_name(folder.name + "_ours"), folder.with_name(folder.name + "_hf"), to="hf")
    back = reference_class.from_pretrained(folder.with_name(folder.name + "_hf")).eval()
    original = reference_class.from_pretrained(folder).state_dict()
    exported = back.state_dict()
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original), "the round trip changed a weight"
    return back


@pytest.mark.parametrize("name", ["BertForMultipleChoice", "RobertaForMultipleChoice", "BertForNextSentencePrediction",
                                  "BertForPreTraining", "RobertaForCausalLM"])
def test_bert_family_heads_match_transformers(name, tmp_path):
    from support.bert_models import tiny_bert_config

    hf_class = getattr(transformers, name)
    hf = _randomised(hf_class(tiny_bert_config("roberta" if name.startswith("Roberta") else "bert")), tmp_path / "hf")
    auto = {"ForMultipleChoice": mf.AutoModelForMultipleChoice, "ForNextSentencePrediction": mf.AutoModelForNextSentencePrediction,
            "ForPreTraining": mf.AutoModelForPreTraining, "ForCausalLM": mf.AutoModelForCausalLM}
    ours = next(a for suffix, a in auto.items() if name.endswith(suffix)).from_pretrained(tmp_path / "hf")
    assert transformers.AutoModel.from_config(ours.config).__class__ is mf.BertModel
    choices = "MultipleChoice" in name
    ids = torch.randint(5, 128, (2, 3, 8) if choices else (2, 8))
    kw = {"labels": torch.tensor([1, 2] if choices else [0, 1])} if choices or "NextSentence" in name else {}
    back = _round_trip(tmp_path / "hf", hf_class)
    with torch.no_grad():
        a, b, c = ours(ids, **kw), hf(ids, **kw), back(ids, **kw)
        index = 1 if kw else 0
        assert (a[index] - b[index]).abs().max() <= 1e-4
        torch.testing.assert_close(c[index], b[index], **SAME_WEIGHTS_ANOTHER_PATH)
        if kw:
            assert abs(a.loss - b.loss) <= 1e-5


def test_gpt2_double_heads_model_matches_transformers(tmp_path):
    hf = _randomised(transformers.GPT2DoubleHeadsModel(tiny_hf_config("gpt2")), tmp_path / "hf")
    ours = mf.GPTDoubleHeadsModel.from_pretrained(tmp_path / "hf")  # an HF checkpoint, converted on load
    ids = torch.randint(3, 128, (2, 3, 8))
    kw = dict(mc_token_ids=torch.tensor([[7, 5, 3], [1, 2, 7]]), labels=ids, mc_labels=torch.tensor([0, 2]))
    back = _round_trip(tmp_path / "hf", transformers.GPT2DoubleHeadsModel)
    with torch.no_grad():
        a, b = ours(ids, **kw), hf(ids, **kw)
        assert (a.logits - b.logits).abs().max() <= 1e-4 and (a.mc_logits - b.mc_logits).abs().max() <= 1e-4
        assert abs(a.loss - b.loss) <= 1e-5 and abs(a.mc_loss - b.mc_loss) <= 1e-5
        torch.testing.assert_close(back(ids, **kw).mc_logits, b.mc_logits, **SAME_WEIGHTS_ANOTHER_PATH)


def test_vit_masked_image_modeling_checkpoints_load(tmp_path):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                    image_size=16, patch_size=4, encoder_stride=4)
    hf = transformers.ViTForMaskedImageModeling(config)
    with torch.no_grad():
        hf.vit.embeddings.mask_token.normal_()
    hf = _randomised(hf, tmp_path / "hf")
    ours = mf.AutoModelForMaskedImageModeling.from_pretrained(tmp_path / "hf")
    pixels, masked = torch.randn(2, 3, 16, 16), torch.rand(2, 16) > 0.5
    back = _round_trip(tmp_path / "hf", transformers.ViTForMaskedImageModeling)
    with torch.no_grad():
        a, b = ours(pixels, bool_masked_pos=masked), hf(pixels, bool_masked_pos=masked)
        assert (a.reconstruction - b.reconstruction).abs().max() <= 1e-4 and abs(a.loss - b.loss) <= 1e-5
        torch.testing.assert_close(back(pixels, bool_masked_pos=masked).reconstruction, b.reconstruction,
                                   **SAME_WEIGHTS_ANOTHER_PATH)


def test_model_classes_load_hf_checkpoints_as_transformers_classes_do(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "llama")
    model = mf.GPTForCausalLM.from_pretrained(tmp_path / "llama")  # as LlamaForCausalLM.from_pretrained reads
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= 1e-4
    model.save_pretrained(tmp_path / "ours")
    assert isinstance(mf.GPTForCausalLM.from_pretrained(tmp_path / "ours"), mf.GPTForCausalLM)  # transformers' path
    with pytest.raises(ConfigError, match="holds a gpt model; BertModel is not one of that family's classes"):
        mf.BertModel.from_pretrained(tmp_path / "llama")


# -- 8. T5's stacks and fp16 loading -------------------------------------------------------------------------------------


def test_t5_stacks_take_input_ids_and_keep_wo_in_float32(tmp_path):
    from support.t5_models import batch, load_hf, save_tiny_hf

    save_tiny_hf("t5_v1_1", tmp_path / "t5")
    ours, hf = mf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5"), load_hf(tmp_path / "t5", "t5_v1_1")
    ids, mask, labels = batch(rows=2, source=12, target=6)
    decoder_ids = labels.clamp(min=0)
    with torch.no_grad():
        encoded = ours.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (encoded - hf.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state).abs().max() <= 1e-4
        kw = dict(input_ids=decoder_ids, encoder_hidden_states=encoded, encoder_attention_mask=mask)
        a, b = ours.get_decoder()(**kw).last_hidden_state, hf.get_decoder()(**kw).last_hidden_state
        assert (a - b).abs().max() <= 1e-4
        # Called alone, the decoder opens its own cache as transformers' does; one step on it gives the full pass's last
        # position.
        cache, reference = output_cache(ours.get_decoder()(**kw)), output_cache(hf.get_decoder()(**kw))
        assert cache is not None and cache.get_seq_length() == reference.get_seq_length() == decoder_ids.shape[1]
        step = torch.randint(1, 100, (2, 1))
        full = ours.get_decoder()(**{**kw, "input_ids": torch.cat([decoder_ids, step], 1)}, use_cache=False)
        assert output_cache(full) is None
        one = ours.get_decoder()(**{**kw, "input_ids": step}, past_key_values=cache).last_hidden_state
        assert (one[:, 0] - full.last_hidden_state[:, -1]).abs().max() <= 1e-4
    assert ours.get_decoder() is ours.model.decoder and ours.get_encoder().embed_tokens is ours.model.shared
    assert "down_proj" in ours._keep_in_fp32_modules and "wo" in hf._keep_in_fp32_modules
    half = mf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5", dtype=torch.float16)
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5", dtype=torch.float16).eval()
    assert half.model.encoder.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert half.model.encoder.layers[0].mlp.up_proj.weight.dtype == torch.float16
    with torch.no_grad():
        a, b = half(ids, attention_mask=mask, labels=labels).logits, reference(ids, attention_mask=mask, labels=labels).logits
    assert a.dtype == b.dtype and (a.float() - b.float()).abs().max() <= 3e-2  # a few float16 steps at |logit| ~ 10


# -- generation: what transformers' GenerationTesterMixin checks, on the same weights ------------------------------------

GENERATE_CASES = {
    "beam_search": dict(num_beams=3, num_return_sequences=2, max_new_tokens=5, length_penalty=0.7, output_scores=True,
                        return_dict_in_generate=True),
    "processors": dict(max_new_tokens=6, repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[5], [7, 8]],
                       min_new_tokens=3),
    "sampling": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.7, max_new_tokens=5),
    # transformers' StaticCache: its generation builds one mask per config.layer_types kind
    "static_cache": dict(max_new_tokens=6, cache_implementation="static"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generation_modes_match_transformers(case):
    hf = tiny_hf_model("llama")
    ours = _ours_from(hf)
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding
    kw = dict(attention_mask=mask, pad_token_id=0, **GENERATE_CASES[case])
    torch.manual_seed(0)
    a = ours.generate(ids, **kw)
    torch.manual_seed(0)
    b = hf.generate(ids, **kw)
    if case != "beam_search":
        assert torch.equal(a, b)
        return
    assert torch.equal(a.sequences, b.sequences) and (a.sequences_scores - b.sequences_scores).abs().max() <= 1e-4
    transition = ours.compute_transition_scores(a.sequences, a.scores, a.beam_indices, normalize_logits=False)
    reference = hf.compute_transition_scores(b.sequences, b.scores, b.beam_indices, normalize_logits=False)
    assert (transition - reference).abs().max() <= 1e-4


def test_gpt2_generates_with_token_type_ids_as_transformers():
    """Found by transformers' GenerationTesterMixin on GPT-2: generate refused token_type_ids as unused."""
    hf = tiny_hf_model("gpt2")
    ours = _ours_from(hf)
    ids, types = torch.randint(3, 128, (2, 6)), torch.randint(0, 3, (2, 6))
    for kw in (dict(do_sample=False), dict(num_beams=2)):
        kw.update(token_type_ids=types, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


def test_generate_from_embeddings_and_assisted_decoding_match_transformers():
    hf = tiny_hf_model("llama")
    ours, assistant = _ours_from(hf), _ours_from(tiny_hf_model("llama"))
    ids = torch.randint(3, 128, (1, 6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        embedded = ours.get_input_embeddings()(ids)
    assert torch.equal(ours.generate(inputs_embeds=embedded, **kw), hf.generate(inputs_embeds=embedded, **kw))
    expected = hf.generate(ids, **kw)
    assert torch.equal(ours.generate(ids, assistant_model=assistant, **kw), expected)
    assert torch.equal(ours.generate(ids, prompt_lookup_num_tokens=3, **kw), expected)
