"""GPT family behaviour: flavours, presets, Auto classes, sequence classification parity, clear errors."""

import json

import pytest
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, tiny_hf_model
from mindformers_py.errors import CheckpointError, ConfigError, MindFormersError


def tiny(flavour="gpt2", **kw):
    cfg = dict(flavour=flavour, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    return mf.GPTConfig(**{**cfg, **kw})


def test_flavours_fill_defaults_and_explicit_values_win():
    gpt2, llama = tiny("gpt2"), tiny("llama", num_key_value_heads=2)
    assert (gpt2.position_embedding_type, gpt2.norm_type, gpt2.gated_mlp, gpt2.tie_word_embeddings) == ("learned", "layernorm", False, True)
    assert (llama.position_embedding_type, llama.norm_type, llama.gated_mlp, llama.tie_word_embeddings) == ("rope", "rmsnorm", True, False)
    assert tiny("llama", attention_bias=True).attention_bias is True
    assert gpt2.intermediate_size == 128 and llama.intermediate_size % 256 == 0
    assert mf.GPTConfig(num_layers=3, flavour="gpt2").num_hidden_layers == 3  # MindFormers alias


def test_config_roundtrip_through_json(tmp_path):
    cfg = tiny("llama", num_key_value_heads=2, sliding_window=8)
    cfg.save_pretrained(tmp_path)
    again = mf.AutoConfig.from_pretrained(tmp_path)
    assert again.to_dict() == cfg.to_dict()


def test_presets_listed_and_buildable(capsys):
    table = mf.AutoConfig.show_support_list()
    assert {"gpt_tiny", "gpt_small", "gpt_medium", "gpt_1.3b", "llama_1b"} <= set(table["gpt"])
    assert "gpt_small" in capsys.readouterr().out
    small = mf.AutoConfig.from_pretrained("gpt_small")
    assert (small.num_hidden_layers, small.hidden_size, small.vocab_size) == (12, 768, 50257)
    model = mf.AutoModelForCausalLM.from_pretrained("gpt_tiny")
    assert isinstance(model, mf.GPTForCausalLM) and not model.training
    assert mf.AutoConfig.for_model("llama_tiny", num_hidden_layers=2).num_hidden_layers == 2


def test_gpt_small_matches_gpt2_parameter_count():
    with torch.device("meta"):
        ours = mf.GPTForCausalLM(mf.AutoConfig.from_pretrained("gpt_small"))
        ref = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert ours.num_parameters() == ref.num_parameters() == 124439808


def test_registered_with_transformers_auto_classes():
    cfg = tiny()
    assert isinstance(transformers.AutoConfig.for_model("mindformers_gpt"), mf.GPTConfig)
    assert isinstance(transformers.AutoModelForCausalLM.from_config(cfg), mf.GPTForCausalLM)
    assert isinstance(transformers.AutoModelForSequenceClassification.from_config(cfg), mf.GPTForSequenceClassification)
    assert isinstance(transformers.AutoModel.from_config(cfg), mf.GPTModel)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sequence_classification_matches_hf(kind, tmp_path):
    hf = tiny_hf_model(kind, head="sequence_classification", num_labels=3)
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (3, 9))
    ids[0, 6:] = 0  # right padding with pad_token_id=0
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        a, b = ours(ids, labels=labels), hf(ids, labels=labels)
    assert (a.logits - b.logits).abs().max() <= 1e-4
    assert abs(a.loss - b.loss) <= 1e-5


def test_base_model_loads_from_causal_lm_checkpoint(tmp_path):
    lm = mf.GPTForCausalLM(tiny())
    lm.save_pretrained(tmp_path)
    base = mf.AutoModel.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, lm.model(ids).last_hidden_state)


def test_loss_matches_manual_shifted_cross_entropy():
    model = mf.GPTForCausalLM(tiny()).eval()
    ids = torch.randint(0, VOCAB, (2, 10))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, atol=1e-6)
    n = (labels[:, 1:] != -100).sum()
    summed = model(ids, labels=labels, num_items_in_batch=n * 2).loss
    assert torch.allclose(summed, ref / 2, atol=1e-6)


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(tiny("llama", num_key_value_heads=2)).train()
    ids = torch.randint(0, VOCAB, (2, 12))
    model(ids, labels=ids).loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for g, r in zip((p.grad for p in model.parameters()), ref):
        assert torch.allclose(g, r, atol=1e-6)


# ----------------------------------------------------------------- bad input: clear one-line errors
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError) as e:
        mf.AutoModelForCausalLM.from_pretrained("gpt_gigantic")
    assert "gpt_tiny" in one_line(e) and "gpt_gigantic" in one_line(e)


def test_unknown_flavour_and_bad_sizes():
    with pytest.raises(ConfigError) as e:
        tiny("bert")
    assert "flavour" in one_line(e) and "'llama'" in one_line(e)
    with pytest.raises(ConfigError) as e:
        tiny(hidden_size=30)
    assert "num_attention_heads" in one_line(e)
    with pytest.raises(ConfigError) as e:
        tiny("llama", num_key_value_heads=3)
    assert "num_key_value_heads" in one_line(e)


def test_folder_without_weights(tmp_path):
    tiny().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as e:
        mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "no weights" in one_line(e) and "model.safetensors" in one_line(e)


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError) as e:
        mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "config.json" in one_line(e)


def test_weights_that_do_not_match_config(tmp_path):
    mf.GPTForCausalLM(tiny()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "do not match" in one_line(e)


def test_damaged_weights_file(tmp_path):
    mf.GPTForCausalLM(tiny()).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError) as e:
        mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "model.safetensors" in one_line(e)


def test_unsupported_hf_architecture(tmp_path):
    transformers.XLNetConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, d_inner=32).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "'xlnet'" in one_line(e) and "gpt2" in one_line(e) and "qwen2" in one_line(e)
    # a family we have, asked for a head it lacks, names the heads it has
    transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        mf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert "bert family has no seq2seq_lm model" in one_line(e) and "masked_lm" in one_line(e)


def test_prompt_longer_than_context():
    model = mf.GPTForCausalLM(tiny()).eval()
    with pytest.raises(MindFormersError) as e:
        model(torch.zeros(1, 40, dtype=torch.long))
    assert "max_position_embeddings=32" in one_line(e)
    with pytest.raises(MindFormersError):
        model.generate(torch.zeros(1, 20, dtype=torch.long), max_new_tokens=20, do_sample=False)


def test_export_refuses_what_hf_cannot_represent(tmp_path):
    mf.GPTForCausalLM(tiny("gpt2", norm_type="rmsnorm")).save_pretrained(tmp_path / "m")
    with pytest.raises(MindFormersError) as e:
        mf.convert_checkpoint(tmp_path / "m", tmp_path / "hf", to="hf")
    assert "norm_type" in one_line(e)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError) as e:
        mf.convert_checkpoint(tmp_path / "m", tmp_path / "x", to="onnx")
    assert "'hf'" in one_line(e)
