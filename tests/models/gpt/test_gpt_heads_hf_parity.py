"""Every GPT task head against transformers' own class on the same weights: HF checkpoints of gpt2/llama/mistral/
qwen2/qwen3/qwen3_moe sequence-classification, token-classification and question-answering models load with equal outputs and
losses (single-label, multi-label and regression for the sequence classifier), and export back to the same
transformers class."""

import pytest
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, tiny_hf_model

KINDS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


def _ids():
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    ids[0, 6:] = 0  # right padding with pad_token_id=0
    return ids


def _close(ours, hf, fields):
    for name in fields:
        assert (getattr(ours, name) - getattr(hf, name)).abs().max() <= 1e-4, name


def _roundtrip(hf_model, src, tmp_path, auto):
    """Our copy of an HF checkpoint, exported back: transformers loads the same class with the same weights."""
    mf.convert_checkpoint(src, tmp_path / "ours", to="mindformers")
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    back = auto.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == type(hf_model).__name__
    hf_state, back_state = hf_model.state_dict(), back.state_dict()
    assert hf_state.keys() == back_state.keys()
    for key, value in hf_state.items():
        assert torch.equal(value, back_state[key]), key


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("problem", ["single_label_classification", "multi_label_classification", "regression"])
def test_sequence_classification(kind, problem, tmp_path):
    num_labels = 1 if problem == "regression" else 3
    hf = tiny_hf_model(kind, head="sequence_classification", num_labels=num_labels, problem_type=problem)
    hf.save_pretrained(tmp_path / "hf")
    ours = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert isinstance(ours, mf.GPTForSequenceClassification) and ours.config.problem_type == problem
    labels = {"single_label_classification": torch.tensor([0, 2, 1]),
              "multi_label_classification": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]]),
              "regression": torch.tensor([0.5, -1.0, 2.0])}[problem]
    with torch.no_grad():
        a, b = ours(_ids(), labels=labels), hf(_ids(), labels=labels)
    _close(a, b, ["logits", "loss"])
    _roundtrip(hf, tmp_path / "hf", tmp_path, transformers.AutoModelForSequenceClassification)


@pytest.mark.parametrize("kind", KINDS)
def test_token_classification(kind, tmp_path):
    hf = tiny_hf_model(kind, head="token_classification", num_labels=5)
    hf.save_pretrained(tmp_path / "hf")
    ours = mf.AutoModelForTokenClassification.from_pretrained(tmp_path / "hf")
    assert isinstance(ours, mf.GPTForTokenClassification)
    labels = torch.randint(0, 5, (3, 9)).masked_fill(_ids() == 0, -100)
    with torch.no_grad():
        a, b = ours(_ids(), labels=labels), hf(_ids(), labels=labels)
        c = ours(_ids(), labels=labels, num_items_in_batch=40)
    _close(a, b, ["logits", "loss"])
    # with num_items_in_batch the summed loss is divided by it (transformers' token classifiers ignore it)
    assert abs(c.loss - a.loss * (labels != -100).sum() / 40) <= 1e-5
    _roundtrip(hf, tmp_path / "hf", tmp_path, transformers.AutoModelForTokenClassification)


@pytest.mark.parametrize("kind", KINDS)
def test_question_answering(kind, tmp_path):
    hf = tiny_hf_model(kind, head="question_answering")
    hf.save_pretrained(tmp_path / "hf")
    ours = mf.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "hf")
    assert isinstance(ours, mf.GPTForQuestionAnswering)
    spans = dict(start_positions=torch.tensor([1, 4, 30]), end_positions=torch.tensor([3, 8, 2]))  # 30: outside, ignored
    with torch.no_grad():
        a, b = ours(_ids(), **spans), hf(_ids(), **spans)
        c = ours(_ids(), **spans, num_items_in_batch=5)
    _close(a, b, ["start_logits", "end_logits", "loss"])
    # with num_items_in_batch each term's sum (positions outside the sequence ignored) is divided by it
    summed = [torch.nn.functional.cross_entropy(logits, target.clamp(0, 9), ignore_index=9, reduction="sum")
              for logits, target in ((a.start_logits, spans["start_positions"]), (a.end_logits, spans["end_positions"]))]
    assert abs(c.loss - (summed[0] + summed[1]) / 10) <= 1e-5
    if kind != "gpt2":  # GPT2ForQuestionAnswering ignores num_items_in_batch
        with torch.no_grad():
            _close(c, hf(_ids(), **spans, num_items_in_batch=5), ["loss"])
    _roundtrip(hf, tmp_path / "hf", tmp_path, transformers.AutoModelForQuestionAnswering)


def test_a_head_missing_from_the_checkpoint_starts_fresh_with_a_warning(tmp_path, caplog):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="mindformers_py"):
        model = mf.AutoModelForQuestionAnswering.from_pretrained(tmp_path)
    assert model.qa_outputs.weight.shape == (2, 32)
    assert "qa_outputs.weight" in caplog.text and "newly initialised" in caplog.text
