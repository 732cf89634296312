"""BERT and RoBERTa checkpoints load into our BERT family with transformers' outputs (fp32, max |Δ| <= 1e-4) for every
head, with padding masks and token types, and export back to checkpoints transformers loads with the same outputs."""

from __future__ import annotations

import pytest
import torch
import transformers

import mindformers_py as mf
from support.bert_models import VOCAB, padded_batch, tiny_bert_config, tiny_bert_model
from mindformers_py.models.bert import BertPreTrainedModel, convert_bert
from mindformers_py.checkpoint.safetensors_io import load_state_dict

TOL = 1e-4
AUTO = {"base": mf.AutoModel, "masked_lm": mf.AutoModelForMaskedLM,
        "sequence_classification": mf.AutoModelForSequenceClassification,
        "token_classification": mf.AutoModelForTokenClassification,
        "question_answering": mf.AutoModelForQuestionAnswering}
OUTPUTS = {"base": ("last_hidden_state", "pooler_output"), "masked_lm": ("logits",), "sequence_classification": ("logits",),
           "token_classification": ("logits",), "question_answering": ("start_logits", "end_logits")}


def _labels(head: str, batch: dict, kind: str) -> dict:
    g = torch.Generator().manual_seed(3)
    rows, length = batch["input_ids"].shape
    if head == "masked_lm":
        labels = batch["input_ids"].clone()
        labels[torch.rand(labels.shape, generator=g) > 0.3] = -100
        return {"labels": labels.masked_fill(batch["attention_mask"] == 0, -100)}
    if head == "sequence_classification":
        return {"labels": torch.randint(0, 3, (rows,), generator=g)}
    if head == "token_classification":
        return {"labels": torch.randint(0, 3, (rows, length), generator=g).masked_fill(batch["attention_mask"] == 0, -100)}
    if head == "question_answering":
        return {"start_positions": torch.tensor([1, 3, 2]), "end_positions": torch.tensor([4, 3, 4])}
    return {}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("head", list(AUTO))
def test_hf_checkpoint_loads_with_the_same_outputs_and_exports_back(kind, head, tmp_path):
    extra = {"num_labels": 3} if head in ("sequence_classification", "token_classification") else {}
    hf = tiny_bert_model(kind, head, **extra)
    hf.save_pretrained(tmp_path / "hf")
    ours = AUTO[head].from_pretrained(tmp_path / "hf")
    assert isinstance(ours, BertPreTrainedModel) and ours.config.hf_architecture == kind
    batch = padded_batch(kind)
    labels = _labels(head, batch, kind)
    with torch.no_grad():
        expected, got = hf(**batch, **labels), ours(**batch, **labels)
    for field in OUTPUTS[head]:
        assert _max_diff(got[field], expected[field]) <= TOL, (field, _max_diff(got[field], expected[field]))
    if labels:
        assert abs(got.loss.item() - expected.loss.item()) <= TOL * max(1.0, abs(expected.loss.item()))

    # ours -> our checkpoint -> HF checkpoint: transformers loads it and gives the same outputs again
    ours.save_pretrained(tmp_path / "ours")
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    back = HF_AUTO[head].from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        again = back(**batch)
    for field in OUTPUTS[head]:
        assert _max_diff(again[field], expected[field]) <= TOL, field


HF_AUTO = {"base": transformers.AutoModel, "masked_lm": transformers.AutoModelForMaskedLM,
           "sequence_classification": transformers.AutoModelForSequenceClassification,
           "token_classification": transformers.AutoModelForTokenClassification,
           "question_answering": transformers.AutoModelForQuestionAnswering}


@pytest.mark.parametrize("problem_type, num_labels", [("multi_label_classification", 3), ("regression", 1)])
def test_sequence_classification_problem_types_match_transformers(problem_type, num_labels, tmp_path):
    hf = tiny_bert_model("bert", "sequence_classification", num_labels=num_labels, problem_type=problem_type)
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    batch = padded_batch("bert")
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 2, (3, 3), generator=g).float() if num_labels == 3 else torch.randn(3, generator=g)
    with torch.no_grad():
        expected, got = hf(**batch, labels=labels), ours(**batch, labels=labels)
    assert _max_diff(got.logits, expected.logits) <= TOL
    assert abs(got.loss.item() - expected.loss.item()) <= TOL


def test_pretraining_head_matches_transformers(tmp_path):
    hf = tiny_bert_model("bert", "pretraining")
    hf.save_pretrained(tmp_path)
    config = convert_bert.config_from_hf(hf.config.to_dict())
    ours = mf.BertForPreTraining(config).eval()
    ours.load_state_dict(convert_bert.state_dict_from_hf(load_state_dict(tmp_path), config), strict=False)
    assert ours.lm_head.decoder.weight is ours.model.embed_tokens.weight
    batch = padded_batch("bert")
    labels = batch["input_ids"].masked_fill(torch.rand(batch["input_ids"].shape) > 0.3, -100)
    nsp = torch.tensor([0, 1, 1])
    with torch.no_grad():
        expected = hf(**batch, labels=labels, next_sentence_label=nsp)
        got = ours(**batch, labels=labels, next_sentence_label=nsp)
    assert _max_diff(got.prediction_logits, expected.prediction_logits) <= TOL
    assert _max_diff(got.seq_relationship_logits, expected.seq_relationship_logits) <= TOL
    assert abs(got.loss.item() - expected.loss.item()) <= TOL
    # every HF tensor found its place: exporting gives the same names back (the tied decoder written once)
    back = convert_bert.state_dict_to_hf(ours.state_dict(), config, "pretraining")
    assert set(back) == set(load_state_dict(tmp_path)) - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} \
        or set(back) <= set(hf.state_dict())


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_hidden_states_attentions_and_tuples_match_transformers(kind, tmp_path):
    hf = tiny_bert_model(kind, "base", attn_implementation="eager")
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModel.from_pretrained(tmp_path, attn_implementation="eager")
    batch = padded_batch(kind)
    with torch.no_grad():
        expected = hf(**batch, output_hidden_states=True, output_attentions=True)
        got = ours(**batch, output_hidden_states=True, output_attentions=True)
        as_tuple = ours(**batch, return_dict=False)
    assert len(got.hidden_states) == len(expected.hidden_states) == 3
    for a, b in zip(got.hidden_states, expected.hidden_states):
        assert _max_diff(a, b) <= TOL
    real = batch["attention_mask"][:, None, :, None].bool()  # padding query rows differ only in masked-out keys
    for a, b in zip(got.attentions, expected.attentions):
        assert _max_diff(a.masked_fill(~real, 0), b.masked_fill(~real, 0)) <= TOL
    assert isinstance(as_tuple, tuple) and _max_diff(as_tuple[0], expected.last_hidden_state) <= TOL


def test_roberta_positions_follow_padding(tmp_path):
    """RoBERTa numbers real tokens from pad_token_id + 1: left padding shifts nothing, as in transformers."""
    hf = tiny_bert_model("roberta", "base")
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModel.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 1, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12]])
    mask = (ids != 1).long()
    with torch.no_grad():
        assert _max_diff(ours(ids, attention_mask=mask).last_hidden_state,
                         hf(ids, attention_mask=mask).last_hidden_state) <= TOL
        embeds = hf.get_input_embeddings()(ids)
        assert _max_diff(ours(inputs_embeds=embeds, attention_mask=mask).last_hidden_state,
                         hf(inputs_embeds=embeds, attention_mask=mask).last_hidden_state) <= TOL


def test_transformers_auto_classes_load_our_checkpoints(tmp_path):
    ours = mf.BertForMaskedLM(mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            max_position_embeddings=32))
    ours.save_pretrained(tmp_path)
    again = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(again) is mf.BertForMaskedLM
    ids = torch.randint(0, VOCAB, (2, 7))
    torch.testing.assert_close(again.eval()(ids).logits, ours.eval()(ids).logits)
    # a base checkpoint (with its pooler) loads into the MLM head, and an MLM one into a classifier (new pooler)
    mf.BertModel(ours.config).save_pretrained(tmp_path / "base")
    mf.AutoModelForMaskedLM.from_pretrained(tmp_path / "base")
    classifier = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=4)
    assert classifier.classifier.out_features == 4


def test_conversion_refuses_what_it_cannot_represent():
    with pytest.raises(mf.ConfigError, match="position_embedding_type"):
        convert_bert.config_from_hf({**tiny_bert_config("bert").to_dict(), "position_embedding_type": "relative_key"})
    with pytest.raises(mf.MindFormersError, match="norm_type"):
        convert_bert.config_to_hf(mf.BertConfig(norm_type="rmsnorm"))


def test_peft_lora_wraps_our_bert_without_target_modules():
    peft = pytest.importorskip("peft")
    model = mf.BertForSequenceClassification(mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, num_labels=3))
    lora = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in trainable) and any("classifier" in n for n in trainable)
    out = lora(input_ids=torch.randint(0, VOCAB, (2, 7)), labels=torch.tensor([0, 2]))
    out.loss.backward()
    assert out.logits.shape == (2, 3)
