"""Damaged or foreign files in a model folder give one line naming the file, never a traceback, through
``from_pretrained``, ``pipeline()`` and the CLI: weights cut short, a config that is not JSON, a pickle saved under the
safetensors name, only a pickle (``pytorch_model.bin``), a tokenizer file that is not JSON."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import mindformers_py as mf
from support.bert_models import wordpiece_tokenizer
from mindformers_py.cli import main
from mindformers_py.errors import CheckpointError


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-64])


DAMAGES = {
    "weights_cut_short": (lambda d: _cut(d / "model.safetensors"), r"model.safetensors is cut short \(\d+ of \d+ bytes\)"),
    "config_not_json": (lambda d: (d / "config.json").write_text("{'not': json"), r"config.json is not valid JSON"),
    "pickle_named_safetensors": (lambda d: torch.save({"w": torch.zeros(2)}, d / "model.safetensors"),
                                 r"model.safetensors is a pickle \(torch.save\) file, not safetensors; pickles are never loaded"),
    "pickle_only": (lambda d: ((d / "model.safetensors").unlink(), torch.save({"w": torch.zeros(2)}, d / "pytorch_model.bin")),
                    r"no weights in .*pickle_only: expected model.safetensors .*found: .*pytorch_model.bin.*only safetensors"),
    "tokenizer_not_json": (lambda d: (d / "tokenizer.json").write_text("{bad"), r"tokenizer.json .* is not valid JSON"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "good"
    tokenizer = wordpiece_tokenizer(folder)
    torch.manual_seed(0)
    mf.BertForMaskedLM(mf.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_is_one_line_naming_it_everywhere(good, tmp_path, damage, capsys):
    folder = tmp_path / damage
    shutil.copytree(good, folder)
    hurt, pattern = DAMAGES[damage]
    hurt(folder)
    loaders = [lambda: mf.pipeline("fill-mask", model=str(folder))]
    if damage != "tokenizer_not_json":  # from_pretrained reads no tokenizer
        loaders.append(lambda: mf.AutoModelForMaskedLM.from_pretrained(folder))
    for load in loaders:
        with pytest.raises(CheckpointError, match=pattern) as err:
            load()
        error = err.value  # one line, and no other exception chained to it in a traceback
        assert "\n" not in str(error) and error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    recipe = tmp_path / "predict.yaml"
    recipe.write_text(yaml.safe_dump({"run_mode": "predict", "task": "masked_lm", "model": {"name_or_path": str(folder)},
                                      "data": {"block_size": 32}, "training": {"output_dir": str(tmp_path / "out")},
                                      "generate": {"prompts": ["paris is the [MASK] of france"]}}))
    assert main(["run", str(recipe)]) == 2
    stderr = capsys.readouterr().err
    err_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and "Traceback" not in stderr
    assert re.search(pattern, err_lines[0]), err_lines[0]
