"""``import mindformers_py`` is cheap and still registers our model types with transformers' Auto classes.

The package imports neither torch nor transformers until a name needs them (PEP 562 re-exports), and our model types
reach transformers' Auto classes as deferred entries (:mod:`mindformers_py.models.lazy_registration`). These tests
hold both: every public name resolves, a fresh process loads a folder we saved through transformers' own Auto classes
(whichever of the two is imported first), and reading the family table imports no modeling code.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mindformers_py
from mindformers_py.models import registry
from mindformers_py.models.lazy_registration import BUILTIN_CONFIGS

LAZY_PACKAGES = ["mindformers_py", "mindformers_py.data", "mindformers_py.engine", "mindformers_py.generation",
                 "mindformers_py.layers", "mindformers_py.parallel", "mindformers_py.recipes", "mindformers_py.trainer",
                 "mindformers_py.models.gpt", "mindformers_py.models.bert", "mindformers_py.models.t5",
                 "mindformers_py.models.vit"]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package}.__all__ names that do not resolve: {missing}"
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        getattr(module, "NoSuchName")


def test_builtin_table_matches_the_families():
    """The deferred table names each family's package and config class, as the families register them."""
    families = {f.config_class.model_type: f.config_class for f in registry.FAMILIES}
    assert set(BUILTIN_CONFIGS) == set(families)
    for model_type, (package, name) in BUILTIN_CONFIGS.items():
        assert getattr(importlib.import_module(package), name) is families[model_type]


_CHILD = r"""
import json, sys
folder, transformers_first = sys.argv[1], sys.argv[2] == "1"
if transformers_first:
    import transformers
    transformers.AutoConfig  # transformers' Auto module loads before ours registers
import mindformers_py
report = {"light_import": transformers_first or not any(m in sys.modules for m in ("torch", "transformers"))}
from mindformers_py.models import registry
registry.FAMILIES  # config classes and presets: what plan and config checks need
report["families_without_modeling"] = "transformers.modeling_utils" not in sys.modules
import transformers
config = transformers.AutoConfig.from_pretrained(folder)
model = transformers.AutoModelForCausalLM.from_pretrained(folder)
report["config"] = type(config).__module__ + "." + type(config).__name__
report["model"] = type(model).__module__ + "." + type(model).__name__
bert = transformers.AutoModelForMaskedLM.from_config(transformers.AutoConfig.for_model(
    "mindformers_bert", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
report["bert"] = type(bert).__name__
report["causal_lm_names"] = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get("mindformers_gpt")
# GPTForCausalLM.from_pretrained(<HF or preset>) converts through the Auto classes' loader, mindformers_py.auto unloaded
loader = registry.checkpoint_loader()
report["checkpoint_loader"] = loader and loader.__module__ + "." + loader.__name__
print(json.dumps(report))
"""


def test_transformers_auto_classes_load_our_folder_in_a_fresh_process(tmp_path):
    from mindformers_py import GPTConfig, GPTForCausalLM

    folder = tmp_path / "gpt"
    config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=32)
    GPTForCausalLM(config).save_pretrained(folder)
    root = Path(mindformers_py.__file__).parents[1]
    for transformers_first in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), transformers_first], capture_output=True,
                             text=True, cwd=root, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report == {
            "light_import": True, "families_without_modeling": True,
            "config": "mindformers_py.models.gpt.configuration_gpt.GPTConfig",
            "model": "mindformers_py.models.gpt.modeling_gpt.GPTForCausalLM",
            "bert": "BertForMaskedLM", "causal_lm_names": "GPTForCausalLM",
            "checkpoint_loader": "mindformers_py.auto.load_model_class",
        }, (transformers_first, report)
