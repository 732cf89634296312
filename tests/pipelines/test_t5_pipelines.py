"""text2text-generation, summarization and translation pipelines (removed in transformers 5) give transformers
4.x's outputs: the calls of tests/fixtures/t5_pipelines/cases.py replayed on the committed tiny T5 checkpoint equal
those recorded from transformers 4.57 by make_fixture.py (texts, token ids, output keys and nesting)."""

import json
import sys
from pathlib import Path

import pytest
import torch

import mindformers_py as mf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "t5_pipelines"
sys.path.insert(0, str(FIXTURE))
from cases import CASES, TEXTS  # noqa: E402

EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _json(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_equal_transformers_4(name):
    case = CASES[name]
    # The checkpoint is stored in float16; transformers 4 loaded it in float32 by default (5 keeps float16, as ours).
    model = mf.AutoModelForSeq2SeqLM.from_pretrained(FIXTURE, dtype=torch.float32)
    for key, value in case.get("generation_config", {}).items():
        setattr(model.generation_config, key, value)
    pipe = mf.pipeline(case["task"], model=model, tokenizer=str(FIXTURE), **case["init"])
    call = dict(case["call"])
    if "seed" in call:
        torch.manual_seed(call.pop("seed"))
    assert _json(pipe(case["inputs"], **call)) == EXPECTED["outputs"][name]


def test_pipeline_from_folder_and_aliases():
    pipe = mf.pipeline("text2text_generation", model=str(FIXTURE))
    assert type(pipe).__name__ == "Text2TextGenerationPipeline" and isinstance(pipe.model, mf.T5ForConditionalGeneration)
    out = pipe(TEXTS[0], max_new_tokens=4, num_beams=1)
    assert list(out[0]) == ["generated_text"]
    summarizer = mf.pipeline("summarization", model=str(FIXTURE))
    assert summarizer.prefix == "summarize: "
    assert summarizer.model.config.task_specific_params["summarization"]["prefix"] == "summarize: "  # not consumed


def test_translation_without_task_specific_params_runs_as_transformers_4(tmp_path):
    """transformers 4 translated with no prefix when neither the task nor the model named a language pair."""
    model = mf.AutoModelForSeq2SeqLM.from_pretrained(FIXTURE, task_specific_params=None)
    translator = mf.pipeline("translation", model=model, tokenizer=str(FIXTURE))
    plain = mf.pipeline("text2text-generation", model=model, tokenizer=str(FIXTURE))
    assert translator.prefix in (None, "")
    kw = dict(max_new_tokens=4, num_beams=1)
    assert [r["translation_text"] for r in translator(TEXTS[:2], **kw)] == \
        [r["generated_text"] for r in plain(TEXTS[:2], **kw)]


def test_bad_input_is_refused_in_one_line(tmp_path):
    model = mf.AutoModelForSeq2SeqLM.from_pretrained(FIXTURE, task_specific_params=None)
    with pytest.raises(mf.ConfigError, match="task='summarise' is not valid"):
        mf.pipeline("summarise", model=model, tokenizer=str(FIXTURE))
