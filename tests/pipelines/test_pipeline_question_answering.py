"""Extractive question answering gives transformers 4's outputs (the pipeline transformers 5 removed): the same
answers, character offsets and scores on a fixture checkpoint, for every argument transformers 4 took, recorded
by tests/fixtures/qa_transformers4/make_fixture.py under transformers 4.57.6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mindformers_py as mf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qa_transformers4"
RECORDED = json.loads((FIXTURE / "expected.json").read_text())["calls"]


@pytest.fixture(scope="module")
def qa():
    return mf.pipeline("question-answering", model=FIXTURE / "checkpoint")


def _same(got, expected) -> None:
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected):
            _same(g, e)
        return
    assert (got["answer"], got["start"], got["end"]) == (expected["answer"], expected["start"], expected["end"]), (got, expected)
    assert got["score"] == pytest.approx(expected["score"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_question_answering_matches_transformers_4(qa, name):
    call = RECORDED[name]
    _same(qa(*call["args"], **call["kwargs"]), call["output"])


def test_our_qa_model_is_used_and_windows_cover_long_contexts(qa):
    assert isinstance(qa.model, mf.BertForQuestionAnswering)
    call = RECORDED["long_context_windows"]["kwargs"]
    windows = list(qa.preprocess({"question": call["question"], "context": call["context"]}, max_seq_len=32, doc_stride=8))
    assert len(windows) > 3 and windows[-1]["is_last"] and max(w["input_ids"].shape[1] for w in windows) <= 32


@pytest.mark.parametrize("kwargs, needle", [
    ({"question": "What is the capital?"}, "context"),
    ({"question": "What is the capital?", "context": ""}, "context"),
    ({"context": "Paris is the capital."}, "question"),
    ({"question": ["a?", "b?"], "context": ["one context"]}, "2 questions and 1 contexts"),
    ({"question": "Where?", "context": "Paris.", "top_k": 0}, "top_k"),
    ({"question": "Where?", "context": "Paris.", "doc_stride": 100, "max_seq_len": 32}, "doc_stride"),
])
def test_bad_questions_give_one_line_errors(qa, kwargs, needle):
    with pytest.raises(mf.MindFormersError) as err:
        qa(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
