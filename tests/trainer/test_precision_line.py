"""A run says which precision it trains in and why, right under its layout line: the same recipe takes about
twice as long where bf16 resolves to fp32 (no native bf16), and the user should see which case a run is."""

from __future__ import annotations

import json

import pytest
import torch

import mindformers_py as mf
from mindformers_py.engine import precision
from mindformers_py.trainer.run_description import precision_line

CPU = torch.device("cpu")


@pytest.fixture
def cpu_with(monkeypatch):
    def pretend(capabilities: dict[str, bool]) -> None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    return pretend


def _args(**kwargs):
    return mf.TrainingArguments(output_dir="unused", use_cpu=True, **kwargs)


def _train_one_step(tmp_path, capsys):
    """One step of a tiny GPT on the CPU: its arguments and the lines it printed."""
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           max_position_embeddings=16))
    data = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(2)]
    args = mf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                save_strategy="no", report_to="none", disable_tqdm=True, plot_loss_curve=False,
                                use_cpu=True)
    mf.Trainer(model=model, args=args, train_dataset=data).train()
    return args, capsys.readouterr().out.splitlines()


def test_auto_on_a_cpu_with_native_bf16(cpu_with):
    cpu_with({"avx512_bf16": True})
    assert precision_line(_args(), CPU) == (
        "precision: bf16 autocast (matrix products in bf16; weights, gradients and optimizer state in fp32), "
        "chosen by bf16='auto': this CPU computes bf16 natively (avx512_bf16)")


def test_auto_on_an_avx2_cpu_says_fp32_and_why(cpu_with):
    cpu_with({"avx2": True})
    assert precision_line(_args(), CPU) == (
        "precision: fp32, chosen by bf16='auto': this CPU has no native bf16 (AVX-512 BF16, AMX or ARM's BF16), "
        "where bf16 would be slower than fp32")


def test_an_explicit_setting_is_named_with_the_hardware(cpu_with):
    cpu_with({"avx512_bf16": True})
    assert precision_line(_args(bf16=False), CPU) == (
        "precision: fp32; bf16=False: this CPU computes bf16 natively (avx512_bf16)")
    cpu_with({"avx2": True})
    assert precision_line(_args(bf16=True), CPU).endswith(
        "; bf16=True: this CPU has no native bf16 (AVX-512 BF16, AMX or ARM's BF16) (bf16 emulated: slower than fp32)")


def test_the_line_is_printed_under_the_layout_and_logged(tmp_path, capsys, cpu_with):
    cpu_with({"avx2": True})
    args, printed = _train_one_step(tmp_path, capsys)
    assert printed[0].startswith("1 process (stand_alone)") and printed[1].startswith("precision: fp32, chosen by")
    first = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert first["precision"] == printed[1]
    assert precision.native_bf16(CPU) is False  # what the Trainer saw


def test_the_compile_line_says_what_auto_decided_and_why(tmp_path, capsys):
    """torch_compile="auto" is off on the CPU (compiled layers are slower there): the run says so under the
    precision line; an explicit setting is named as given."""
    from mindformers_py.trainer.run_description import compile_line

    assert compile_line(_args()) == ("compile: off (eager), chosen by torch_compile='auto': training on cpu, "
                                      "where compiled layers are slower than eager ones")
    assert compile_line(_args(torch_compile=True)) == (
        "compile: each transformer layer (the first step pays the compilation); torch_compile=True")
    assert compile_line(_args(torch_compile=False)) == "compile: off (eager); torch_compile=False"
    args, printed = _train_one_step(tmp_path, capsys)
    assert printed[2] == compile_line(args)
    assert json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])["compile"] == printed[2]


def test_auto_gives_its_reason_on_cuda_for_each_layout(monkeypatch):
    """What "auto" says on a CUDA device (decided without one: the training device is what the policy asks)."""
    from mindformers_py.engine import compile_policy

    monkeypatch.setattr(compile_policy, "training_device", lambda use_cpu: torch.device("cuda"))
    assert compile_policy.resolve_torch_compile("auto", False) is True
    assert "faster and leaner" in compile_policy.auto_reason(False)
    cp2 = mf.ParallelConfig(parallel_mode="semi_auto_parallel", context_parallel=2)
    assert compile_policy.resolve_torch_compile("auto", False, cp2) is False
    assert compile_policy.auto_reason(False, cp2).startswith("context parallelism")
    planned = mf.ParallelConfig(parallel_mode="auto_parallel")
    assert compile_policy.auto_reason(False, planned).startswith("the auto_parallel planner")


def test_a_model_loaded_in_bf16_says_its_products_run_in_bf16_and_how_to_train_in_fp32(tmp_path, capsys, cpu_with):
    """An adapter run of a bf16 checkpoint keeps the frozen base in bf16: with no autocast its products still run in
    bf16, emulated (minutes a step) on a CPU without native bf16, though the line used to say fp32."""
    from mindformers_py.trainer.run_description import weights_dtype

    cpu_with({"avx2": True})
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, max_position_embeddings=16)).to(torch.bfloat16)
    assert weights_dtype(model) == torch.bfloat16
    line = precision_line(_args(), CPU, weights_dtype(model))
    assert line.startswith("precision: fp32, chosen by bf16='auto'")
    assert "the model's weights are bf16 (as loaded): its products run in bf16, emulated on this CPU" in line
    assert line.endswith("a recipe: --model.dtype float32) to train in fp32 at twice the weights' memory")
    cpu_with({"avx512_bf16": True})
    assert precision_line(_args(), CPU, torch.bfloat16).endswith("its products run in bf16")
    assert precision_line(_args(), CPU, torch.float32) == precision_line(_args(), CPU)
