"""peft adapters in one process: ``peft:`` sections (and MindFormers' ``pet_config``) as peft's own configs, one-line
refusals of bad sections, the Trainer's ``peft_config`` (only the adapter trained, saved and checkpointed; an exact
resume), the export of a saved adapter under transformers' names (loaded by ``PeftModel.from_pretrained`` on
transformers' own model, giving our logits), the merged export, and the planner's adapter-only optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
import yaml

import mindformers_py as mf
from mindformers_py.adapters import apply_peft, peft_config_from_dict
from mindformers_py.cli import main
from mindformers_py.errors import ConfigError

VOCAB = 64


def gpt(flavour: str = "gpt2") -> mf.GPTForCausalLM:
    extra = {"num_key_value_heads": 2} if flavour == "llama" else {}
    config = mf.GPTConfig(flavour=flavour, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=32, **extra)
    return mf.GPTForCausalLM(config)


# -- sections -------------------------------------------------------------------------------------------------


def test_peft_section_is_peft_own_config():
    config = peft_config_from_dict({"type": "LoRA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
                                   task="causal_lm")
    assert isinstance(config, peft.LoraConfig) and config.r == 8 and config.task_type == "CAUSAL_LM"
    assert isinstance(peft_config_from_dict({"peft_type": "IA3"}), peft.IA3Config)
    assert peft_config_from_dict({"type": "lora"}, task="sequence_classification").task_type == "SEQ_CLS"


def test_mindformers_pet_config_is_read_as_peft():
    config = peft_config_from_dict({"pet_type": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                                    "target_modules": ".*wq|.*wv", "exclude_layers": ".*layers.0.*"}, "pet_config")
    assert isinstance(config, peft.LoraConfig) and config.r == 8 and config.lora_alpha == 16
    assert config.target_modules == ".*q_proj|.*v_proj" and config.exclude_modules == ".*layers.0.*"
    model = apply_peft(gpt("llama"), {"pet_type": "lora", "lora_rank": 2, "target_modules": ".*wq|.*w2"},
                       name="pet_config")
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "down_proj"}


@pytest.mark.parametrize("section, needle", [
    ({"type": "lorra"}, "peft.type='lorra' is not a peft adapter type (did you mean 'lora'?)"),
    ({"type": "lora", "rank": 4}, "peft.rank is not a LoraConfig field"),
    ({"type": "lora", "target_modules": ["query"]}, "peft.target_modules: 'query' is not a module of GPTForCausalLM"),
    ({"type": "lora", "r": 64}, "peft.r=64 is larger than model.layers.0.self_attn.q_proj (32 -> 32 features)"),
    ({"type": "ia3", "target_modules": ["q_proj"], "feedforward_modules": ["down_proj"]}, "not a valid IA3Config"),
])
def test_bad_sections_are_refused_in_one_line(section, needle):
    model = gpt()
    with pytest.raises(ConfigError) as err:
        apply_peft(model, section, task="causal_lm")
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not any("lora" in n for n, _ in model.named_parameters())  # the model is left as it was


def test_pet_config_keys_without_peft_counterpart_are_refused():
    with pytest.raises(ConfigError, match=r"pet_config.param_init_type is not supported \(adapter weights"):
        peft_config_from_dict({"pet_type": "lora", "param_init_type": "float16"}, "pet_config")


def test_cli_refuses_a_bad_peft_section_before_loading_data(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": "gpt_tiny", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
        "data": {"source": "files", "train_files": str(tmp_path / "absent.txt")},
        "training": {"output_dir": str(tmp_path / "out")},
        "peft": {"type": "lora", "target_modules": ["c_attn"]}}))
    cases = [([], "peft.target_modules: 'c_attn' is not a module of GPTForCausalLM; its layers:"),
             (["--peft.target_modules", "[q_proj]", "--peft.r", "40"], "peft.r=40 is larger than"),
             (["--peft.type", "loraa"], "peft.type='loraa' is not a peft adapter type")]
    for flags, needle in cases:
        assert main(["run", str(recipe), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error:") and needle in err, err


# -- training from Python ----------------------------------------------------------------------------------------


def _rows(n: int = 32) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, VOCAB, (16,), generator=gen).tolist()} for _ in range(n)]


def _train(output_dir: Path, resume: str | None = None) -> tuple[mf.Trainer, list[float]]:
    args = mf.TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                max_steps=4, learning_rate=1e-2, logging_steps=1, save_steps=2, report_to=[],
                                disable_tqdm=True, use_cpu=True, parallel_config={"recompute": "full"}, bf16=False)
    torch.manual_seed(0)
    trainer = mf.Trainer(model=gpt(), args=args, train_dataset=_rows(),
                         peft_config=peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_saves_and_resumes_only_the_adapter(tmp_path):
    trainer, losses = _train(tmp_path / "run")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if n in trained}
    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoint-2"):
        assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    # Resumed from step 2 (dropout in the adapter, accumulation, recompute): the same losses, bit for bit.
    _, resumed = _train(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed[2:] == losses[2:]


# -- export: transformers' model with our adapter gives our logits -------------------------------------------------


CASES = {
    # GPT-2 fuses q/k/v into one transposed c_attn: q and v's LoRAs (ranks 4 and 2, rsLoRA) become one of rank 6
    "gpt2": (lambda: gpt("gpt2"), "causal_lm", transformers.GPT2LMHeadModel,
             {"type": "lora", "r": 4, "use_rslora": True, "rank_pattern": {"v_proj": 2},
              "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"]}),
    "llama": (lambda: gpt("llama"), "causal_lm", transformers.LlamaForCausalLM, {"type": "lora", "r": 4}),
    # BERT's query/value are our q_proj/v_proj; the classifier is trained whole (SEQ_CLS)
    "bert": (lambda: mf.BertForSequenceClassification(mf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=3, max_position_embeddings=32)), "sequence_classification",
             transformers.BertForSequenceClassification, {"type": "lora", "r": 4}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exported_adapter_on_transformers_model_gives_our_logits(name, tmp_path):
    build, task, hf_class, section = CASES[name]
    base = build()
    base.save_pretrained(tmp_path / "base")
    our_class = type(base)
    mf.convert_checkpoint(tmp_path / "base", tmp_path / "base_hf", to="hf")
    torch.manual_seed(1)
    ours = apply_peft(our_class.from_pretrained(tmp_path / "base"), section, task=task)
    with torch.no_grad():  # a trained adapter: every tensor away from its initial value
        for param in ours.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    ours.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ours.eval()(input_ids=ids).logits
        plain = hf_class.from_pretrained(tmp_path / "base_hf").eval()(input_ids=ids).logits
        assert (expected - plain).abs().max() > 1e-2  # the adapter changes the output

        mf.convert_checkpoint(tmp_path / "adapter", tmp_path / "adapter_hf", to="hf")
        theirs = peft.PeftModel.from_pretrained(hf_class.from_pretrained(tmp_path / "base_hf"), tmp_path / "adapter_hf")
        torch.testing.assert_close(theirs.eval()(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)

        reloaded = peft.PeftModel.from_pretrained(our_class.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)

        assert main(["convert", str(tmp_path / "adapter"), str(tmp_path / "merged_hf"), "--to", "hf", "--merge"]) == 0
        merged = hf_class.from_pretrained(tmp_path / "merged_hf").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    if name == "gpt2":
        saved = json.loads((tmp_path / "adapter_hf" / "adapter_config.json").read_text())
        assert saved["target_modules"] == ["attn.c_proj", "c_attn", "c_fc"] and saved["rank_pattern"] == {
            f"transformer.h.{i}.attn.c_attn": 6 for i in range(2)}


# -- LoRA on the experts of a mixture of experts ----------------------------------------------------------------


def test_target_modules_naming_the_experts_projections_adapt_the_experts(tmp_path):
    """A Qwen3-MoE from transformers' own config: target_modules [q_proj, gate_proj, up_proj, down_proj] adapts the
    attention, the dense layer's MLP and every MoE layer's stacked expert projections (peft's target_parameters);
    the adapter reloads, and the model merged and exported to HF qwen3_moe gives the adapter model's logits in
    transformers' own class."""
    from support.hf_models import tiny_hf_model

    tiny_hf_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    base = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    base.save_pretrained(tmp_path / "base")
    section = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}
    torch.manual_seed(1)
    ours = apply_peft(mf.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), section, task="causal_lm")
    config = ours.peft_config["default"]
    assert config.target_parameters == ["experts.down_proj", "experts.gate_proj", "experts.up_proj"]
    assert config.target_modules == {"q_proj", "gate_proj", "up_proj", "down_proj"}  # layer 1 is dense
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert sum("mlp.experts" in n for n in trained) == 2 * 3 * 2  # 2 MoE layers x 3 projections x A, B
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    ours.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ours.eval()(input_ids=ids).logits
        assert (expected - base(input_ids=ids).logits).abs().max() > 1e-3
        reloaded = peft.PeftModel.from_pretrained(mf.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                                  tmp_path / "adapter")
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)
        assert main(["convert", str(tmp_path / "adapter"), str(tmp_path / "merged_hf"), "--to", "hf", "--merge"]) == 0
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged_hf").eval()
        assert type(merged).__name__ == "Qwen3MoeForCausalLM"
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    # unmerged, under transformers' names: its fused gate_up_proj has no place for two adapters: one line, nothing
    assert main(["convert", str(tmp_path / "adapter"), str(tmp_path / "adapter_hf"), "--to", "hf"]) == 2
    assert not (tmp_path / "adapter_hf").exists()
    with pytest.raises(ConfigError, match="lora_dropout=0.05 is not valid with the experts' projections"):
        apply_peft(mf.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), {**section, "lora_dropout": 0.05},
                   task="causal_lm")


# -- the planner -------------------------------------------------------------------------------------------------


def test_planner_counts_optimizer_state_of_the_adapter_alone(tmp_path, capsys):
    from mindformers_py.adapters.counting import adapter_parameter_count
    from mindformers_py.planner.cost_model import as_shape, estimate_memory

    config = mf.AutoConfig.from_pretrained("llama_1b")
    trainable = adapter_parameter_count({"type": "lora", "r": 16}, config)
    assert trainable == 16 * ((2048 + 2048) + (2048 + 512)) * 16  # r x (in + out) of q_proj and v_proj, 16 layers
    layout = mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=8, optimizer_shard=1)
    full = estimate_memory(config, layout, 1, 2048)
    lora = estimate_memory(config, layout, 1, 2048, trainable_params=trainable)
    assert lora.parameters == full.parameters and lora.activations == full.activations
    assert lora.optimizer == pytest.approx(full.optimizer * trainable / as_shape(config).total_params(), rel=1e-6)
    assert lora.gradients < full.gradients / 100
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name_or_path": "llama_1b"}, "data": {"block_size": 2048},
                                      "peft": {"type": "lora", "r": 16}}))
    assert main(["plan", str(recipe), "--devices", "8", "--top", "1"]) == 0
    assert f"peft adapter: {trainable:,} trainable parameters" in capsys.readouterr().out


# -- tensor parallelism of adapters (the sharded runs are in tests/parallel/test_peft_layouts.py) ----------------------


def test_tensor_parallel_styles_follow_the_base_layer_or_refuse_naming_the_module():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from mindformers_py.parallel.tensor.adapters import adapter_styles

    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    lora = apply_peft(gpt("llama"), {"type": "lora", "r": 2, "target_modules": ["q_proj", "o_proj"]}).get_base_model()
    from torch.distributed.tensor import Shard

    styles = adapter_styles(lora, {q: ColwiseParallel(), o: RowwiseParallel(output_layouts=Shard(1))}, tp=2)
    assert {k: type(v) for k, v in styles.items()} == {
        f"{q}.base_layer": ColwiseParallel, f"{q}.lora_B.default": ColwiseParallel,
        f"{o}.base_layer": RowwiseParallel, f"{o}.lora_A.default": RowwiseParallel,
        f"{o}.lora_B.default": SequenceParallel}
    ia3 = apply_peft(gpt("llama"), {"type": "ia3", "target_modules": ["q_proj"], "feedforward_modules": []})
    with pytest.raises(ConfigError, match=rf"model_parallel=2 cannot shard peft's ia3 adapter on {q} \(a colwise"):
        adapter_styles(ia3.get_base_model(), {q: ColwiseParallel()}, tp=2)


def test_prompt_learning_is_refused_under_process_layouts():
    from mindformers_py.adapters.apply import refuse_prompt_learning

    prompt = apply_peft(gpt(), {"type": "prompt_tuning", "num_virtual_tokens": 4}, task="causal_lm")
    with pytest.raises(ConfigError, match=r"peft type 'prompt_tuning' trains in one process only .*pipeline_stage=2"):
        refuse_prompt_learning(prompt, "pipeline_stage=2")
    refuse_prompt_learning(apply_peft(gpt(), {"type": "lora", "r": 2}), "pipeline_stage=2")  # LoRA runs anywhere


@pytest.mark.parametrize("kind", ["ia3", "loha", "oft"])
def test_other_adapters_naming_only_the_experts_projections_are_refused_in_one_line(kind):
    """peft adapts stacked expert weights with LoRA alone (target_parameters); another adapter type whose
    target_modules names the experts' projections, with no dense layer of that name, gets a ConfigError naming the
    names and the type (peft said only that no module matched)."""
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=16, moe_config={
                              "expert_num": 4, "num_experts_chosen": 2, "moe_intermediate_size": 16})
    section = {"type": kind, "target_modules": ["q_proj", "gate_proj", "down_proj"]}
    if kind == "ia3":
        section["feedforward_modules"] = ["down_proj"]
    with pytest.raises(ConfigError, match=rf"projections \(down_proj, gate_proj\), which type={kind} cannot adapt"):
        apply_peft(mf.GPTForCausalLM(config), section, task="causal_lm")
    section = {"type": kind, "target_modules": ["q_proj", "v_proj"]}  # the attention alone is theirs to adapt
    model = apply_peft(mf.GPTForCausalLM(config), section, task="causal_lm")
    assert not any("experts" in n for n, p in model.named_parameters() if p.requires_grad)
