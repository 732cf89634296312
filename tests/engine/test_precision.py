"""``bf16="auto"``: bf16 autocast where the training device computes bf16 natively (a CPU with AVX-512 BF16 / AMX /
ARM BF16, CUDA compute capability >= 8.0), fp32 elsewhere and whenever fp16 is asked for; the arguments hold the
resolved bool and write "auto" back, so a saved run re-decides on other hardware."""

import pytest
import torch

import mindformers_py as mf
from mindformers_py.engine import precision
from mindformers_py.errors import ConfigError


@pytest.mark.parametrize("capabilities, native", [({}, False), ({"avx512_f": True}, False),
                                                  ({"avx512_bf16": True}, True), ({"amx_bf16": True}, True),
                                                  ({"bf16": True}, True)])
def test_cpu_native_bf16_follows_the_instruction_set(monkeypatch, capabilities, native):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert precision.native_bf16("cpu") is native
    args = mf.TrainingArguments(output_dir="unused", use_cpu=True)
    assert args.bf16 is native and args.to_dict()["bf16"] == "auto"
    assert mf.TrainingArguments.from_dict(args.to_dict()) == args
    assert mf.TrainingArguments(output_dir="unused", use_cpu=True, bf16=False).to_dict()["bf16"] is False


@pytest.mark.parametrize("cap, native", [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True),
                                         ("AVX512_CORE_AMX", True), ("ALL", True), ("", True)])
def test_a_onednn_cap_below_bf16_makes_bf16_emulated(monkeypatch, cap, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert precision.native_bf16("cpu") is native


@pytest.mark.parametrize("capability, native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_native_bf16_needs_compute_capability_8(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert precision.native_bf16("cuda") is native


def test_auto_gives_way_to_fp16_and_refuses_other_words(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    assert precision.resolve_bf16("auto", fp16=True, use_cpu=True) is False
    assert mf.TrainingArguments(output_dir="unused", use_cpu=True, bf16="AUTO").bf16 is True
    with pytest.raises(ConfigError, match=r"bf16='sometimes' is not valid; expected true, false or 'auto'"):
        mf.TrainingArguments(output_dir="unused", bf16="sometimes")
