"""Every recipe in tasks/ under layouts against its stand-alone run: the matrix that closes the gap issue 38 found
(fine-tuning recipes that trained garbage or died under layouts while the pretraining ones passed).

Each recipe runs shrunk by flags (tiny widths, fp32, no dropout; the fine-tuning recipes from tiny pretrained
folders the test makes) for one whole epoch of 13 samples with evaluation on 7 and its pipeline on a prompt, so the
global batch of 4 leaves a last batch of 1 (one data-parallel rank without a sample, a pipeline batch its 2
micro-batches do not divide) and the evaluation batches split unevenly; text blocks are 31 tokens and the
classification batches padded to their longest row, lengths sequence parallelism must pad. Every recipe runs under at
least one layout, every layout (dp2, ZeRO-3, tp2, tp2 with sequence parallelism and the vocabulary sharded, pp2, ep2
for MoE, cp2 for the long recipe) under at least one recipe, and each failure the issue found under the recipe and
layout that met it (the comments at :data:`RECIPES`); the full cross product cost too much of the suite's 20 minutes
for what it adds (the models under each layout are checked against stand-alone in tests/parallel). Each run must give stand-alone's
first loss (1e-5) and every step's loss and gradient norm (1e-4: the gradient norm shows a scale a loss would
hide), its evaluation loss, its counters (steps, epoch, num_input_tokens_seen, total_flos), a new classifier of
stand-alone's magnitude, and the saved model (or adapter), loaded again by every rank for the pipeline, must predict
what stand-alone's does. Layouts a recipe cannot run are refused before training, in one line, writing nothing.
Beside the matrix: --run_mode eval under tp2, a saved adapter generating in a worker pool, and --parallel_mode
auto_parallel on this CPU (the pretraining recipe's stand-alone run).

Cost: the stand-alone runs in the test process, one 2-process job for every layout run (run_recipe on the job's
process group, as torchrun's workers do), reading the data and tokenizers the stand-alone runs prepared (cached).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support.dist_utils import run_workers

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tasks"
TRAIN, EVAL, BATCH = 13, 7, 4  # samples: an epoch of 4 steps, the last of one sample; evaluation batches of 4 and 3
COMMON = ["--max_steps", "-1", "--num_train_epochs", "1", "--data.max_train_samples", str(TRAIN),
          "--data.max_eval_samples", str(EVAL), "--gradient_accumulation_steps", "1", "--logging_steps", "1",
          "--eval_strategy", "epoch", "--save_strategy", "no", "--report_to", "[]", "--disable_tqdm", "true",
          "--bf16", "false", "--seed", "42", "--warmup_steps", "0", "--warmup_ratio", "0.0",
          "--generate.max_new_tokens", "4", "--generate.do_sample", "false", "--generate.num_beams", "1"]
TINY_GPT = ["--model.num_hidden_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
            "--model.max_position_embeddings", "64", "--tokenizer.vocab_size", "400", "--data.max_files", "12",
            "--data.block_size", "31"]  # odd: sequence parallelism over 2 ranks pads each block
TINY_T5 = ["--model.num_layers", "1", "--model.hidden_size", "32", "--model.head_dim", "8",
           "--model.num_attention_heads", "4", "--model.intermediate_size", "64", "--model.dropout_rate", "0.0",
           "--tokenizer.vocab_size", "400", "--data.max_files", "12", "--data.block_size", "32"]
NO_DROPOUT = ["--model.hidden_dropout", "0.0", "--model.attention_dropout", "0.0"]


@dataclass(frozen=True)
class Recipe:
    """A recipe at test size: its file, the flags shrinking it, the layouts it runs, and the ones it refuses (layout
    -> a fragment of the one-line error)."""

    path: str
    flags: tuple[str, ...]
    layouts: tuple[str, ...]
    refused: tuple[tuple[str, str], ...] = ()
    prompt: str = "def add(a, b):"
    base: str | None = None
    """The pretrained folder of a fine-tuning recipe, made by the test (:func:`inputs`)."""


RECIPES = {
    # dp2: uneven shares of the last batch and of the evaluation batches, token counts of padded rows; pp2: a last
    # batch its micro-batches do not divide; tp2_sp: dynamic padding to a length tp does not divide
    "bert_classification": Recipe("bert/finetune_classification.yaml", (*NO_DROPOUT, "--data.block_size", "32"),
                                  layouts=("dp2", "pp2", "tp2_sp"), prompt="Return the number of items in the queue.",
                                  base="bert_base"),
    # the new head peft trains whole, initialised as stand-alone's where each layout fills the model
    "bert_classification_lora": Recipe("bert/finetune_classification_lora.yaml",
                                       (*NO_DROPOUT, "--data.block_size", "32", "--peft.lora_dropout", "0.0"),
                                       layouts=("tp2", "pp2", "zero3"), prompt="Return the number of items in the queue.",
                                       base="bert_base"),
    "bert_mlm": Recipe("bert/pretrain_mlm_tiny.yaml",
                       ("--model.num_hidden_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads",
                        "4", "--model.intermediate_size", "64", "--tokenizer.vocab_size", "400", "--data.max_files",
                        "12", "--data.block_size", "31"), layouts=("pp2",),  # FLOPs counted on the whole model
                       prompt="def __init__(self, [MASK]=None):"),
    "gpt_lora": Recipe("gpt/finetune_lora.yaml", ("--data.max_files", "40", "--data.block_size", "64", "--peft.r", "4",
                                                  "--peft.lora_dropout", "0.0"),
                      layouts=("pp2",), base="gpt_base"),  # a LoRA model's tied head across pipeline stages
    "gpt_long": Recipe("gpt/pretrain_long.yaml",
                       ("--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.max_position_embeddings",
                        "64", "--tokenizer.vocab_size", "400", "--data.max_files", "12", "--data.block_size", "32"),
                       layouts=("cp2",)),
    "gpt_pretrain": Recipe("gpt/pretrain_tiny.yaml", TINY_GPT, layouts=("tp2_sp",)),  # blocks of 31 tokens
    "gpt_moe": Recipe("gpt_moe/pretrain_tiny.yaml",
                      (*TINY_GPT, "--model.num_key_value_heads", "2", "--model.moe_config.expert_num", "4",
                       "--model.moe_config.moe_intermediate_size", "32"),
                      layouts=("ep2",), refused=(("tp2_sp", "use_seq_parallel"),)),
    "t5_summarization": Recipe("t5/finetune_summarization.yaml", (*TINY_T5, "--data.max_target_length", "8",
                                                                  "--generation_max_length", "8"),
                               layouts=("dp2", "pp2_loss_only"),  # generated tokens gathered from uneven shares
                               refused=(("pp2", "predict_with_generate"), ("tp2_sp", "use_seq_parallel")),
                               prompt="def area(width, height):\n    return width * height\n"),
    "t5_span": Recipe("t5/pretrain_span_tiny.yaml", TINY_T5, layouts=("zero3",),
                      prompt="def add(a, b):\n    return <extra_id_0>\n"),
    "vit_digits": Recipe("vit/finetune_digits.yaml",
                         ("--model.hidden_size", "32", "--model.num_hidden_layers", "2", "--model.intermediate_size",
                          "64"), layouts=("pp2",), prompt=""),  # pixel rows padded for the micro-batches
}

SEMI = ["--parallel_mode", "semi_auto_parallel"]
HALF_BATCH = ["--per_device_train_batch_size", str(BATCH // 2), "--per_device_eval_batch_size", str(BATCH // 2)]
LAYOUTS = {
    "stand_alone": ["--parallel_mode", "stand_alone", "--context_parallel", "1"],
    "dp2": ["--parallel_mode", "data_parallel", "--data_parallel", "2", *HALF_BATCH],
    "zero3": ["--parallel_mode", "data_parallel", "--data_parallel", "2", "--optimizer_shard", "3", *HALF_BATCH],
    "tp2": [*SEMI, "--model_parallel", "2"],
    "tp2_sp": [*SEMI, "--model_parallel", "2", "--use_seq_parallel", "true", "--vocab_emb_dp", "false"],
    "pp2": [*SEMI, "--pipeline_stage", "2", "--micro_batch_num", "2"],
    "pp2_loss_only": [*SEMI, "--pipeline_stage", "2", "--micro_batch_num", "2", "--predict_with_generate", "false"],
    "ep2": [*SEMI, "--data_parallel", "2", "--expert_parallel", "2", *HALF_BATCH],
    "cp2": [*SEMI, "--context_parallel", "2", "--context_parallel_algo", "ring"],
}
AUTO_PARALLEL_RECIPE = "gpt_pretrain"
CASES = [(name, layout) for name, recipe in RECIPES.items() for layout in recipe.layouts]
REFUSALS = [(name, layout, needle) for name, recipe in RECIPES.items() for layout, needle in recipe.refused]


def flags(name: str, layout: str, out: Path, inputs: Path) -> list[str]:
    recipe = RECIPES[name]
    extra = ["--model.name_or_path", str(inputs / recipe.base)] if recipe.base else []
    prompts = [str(inputs / "digit.png")] if name == "vit_digits" else [recipe.prompt]
    baseline = LAYOUTS["stand_alone"] if layout == "stand_alone" else []
    if layout == "stand_alone" and name == AUTO_PARALLEL_RECIPE:  # what --parallel_mode auto_parallel runs on a CPU
        baseline = ["--parallel_mode", "auto_parallel"]
    return [str(TASKS / recipe.path), *COMMON, "--per_device_train_batch_size", str(BATCH),
            "--per_device_eval_batch_size", str(BATCH), *recipe.flags, *extra, "--generate.prompts",
            json.dumps(prompts), *baseline, *LAYOUTS[layout], "--output_dir", str(out)]


def outcome(out: Path, results: dict) -> dict:
    """What a run is compared by: per-step losses and gradient norms, the final evaluation, the counters and the
    pipeline's answers (from the model saved and loaded again under a layout)."""
    state = json.loads((out / "trainer_state.json").read_text())
    history = state["log_history"]
    evals = [h for h in history if "eval_loss" in h]
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "steps": state["global_step"], "epoch": state["epoch"], "tokens": state["num_input_tokens_seen"],
            "flos": state["total_flos"], "samples": results.get("samples"),
            "saved": sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json")),
            "layout": history[0].get("layout"), "classifier": classifier_magnitude(out)}


def classifier_magnitude(out: Path) -> float | None:
    """The largest absolute weight of a saved classification head (None without one)."""
    from safetensors import safe_open

    values = []
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            values += [f.get_tensor(k).abs().max().item() for k in f.keys() if "classifier" in k]
    return max(values) if values else None


def run_case(name: str, layout: str, work: Path, inputs: Path) -> dict | str:
    """One run's :func:`outcome`, or its error's first line."""
    from mindformers_py.recipes import load_recipe, run_recipe

    out = work / f"{name}-{layout}"
    args = flags(name, layout, out, inputs)
    try:
        results = run_recipe(load_recipe(args[0]), args[1:])
        return outcome(out, results)
    except Exception as err:  # noqa: BLE001 - each case is reported on its own
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def run_eval_case(work: Path) -> dict | str:
    """``--run_mode eval`` under tp2 of the LoRA classification recipe's stand-alone output (its adapter): the
    evaluation and the pipeline's answers from the evaluated model."""
    from mindformers_py.recipes import load_recipe, run_recipe

    saved = work / "bert_classification_lora-stand_alone"
    try:
        results = run_recipe(load_recipe(saved / "run_config.yaml"),
                             ["--run_mode", "eval", "--model.name_or_path", str(saved), "--output_dir",
                              str(work / "eval-tp2"), *LAYOUTS["tp2"]])
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {"eval_loss": results["eval_loss"], "samples": results.get("samples")}


def _job(rank: int, world_size: int, work: str, inputs: str) -> dict:
    out = {case: run_case(*case, Path(work), Path(inputs)) for case in CASES}
    out.update({(name, layout): run_case(name, layout, Path(work), Path(inputs)) for name, layout, _ in REFUSALS})
    out["eval-tp2"] = run_eval_case(Path(work))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The fine-tuning recipes' pretrained checkpoints, tiny: a GPT-2 for the LoRA recipe and a BERT encoder (no
    classifier: the recipes add a new one) with all-MiniLM-L6-v2's tokenizer for the classification recipes, each
    with its tokenizer; and a digit image for the ViT recipe's pipeline."""
    import mindformers_py as mf
    from mindformers_py.data import train_bpe_tokenizer
    from mindformers_py.data.images import digits_dataset
    from mindformers_py.data.stdlib.instructions import docstring_instructions
    from mindformers_py.models.packaged import packaged_checkpoint_path
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("matrix_inputs")
    pairs = docstring_instructions("train", 40)  # the recipe's data: a tokenizer made for it keeps prompts short
    tokenizer = train_bpe_tokenizer([p + r for p, r in zip(pairs["prompt"], pairs["response"])], 600)
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="gpt2", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, embedding_dropout=0.0,
                          attention_dropout=0.0, hidden_dropout=0.0, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    mf.GPTForCausalLM(config).save_pretrained(folder / "gpt_base")
    tokenizer.save_pretrained(folder / "gpt_base")
    minilm = AutoTokenizer.from_pretrained(packaged_checkpoint_path("sentence-transformers/all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    mf.BertModel(mf.BertConfig(vocab_size=len(minilm), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=64, pad_token_id=minilm.pad_token_id)
                 ).save_pretrained(folder / "bert_base")
    minilm.save_pretrained(folder / "bert_base")
    digits_dataset()["validation"][0]["image"].save(folder / "digit.png")
    return folder


@pytest.fixture(scope="module")
def matrix(inputs, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("matrix")
    # The stand-alone runs prepare the data and train the tokenizers (kept in the package's cache, which the other
    # recipe tests share), which the layouts' runs then read.
    results = {(name, "stand_alone"): run_case(name, "stand_alone", work, inputs) for name in RECIPES}
    results.update(run_workers(_job, 2, str(work), str(inputs))[0])
    results["work"] = work
    return results


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(case))
def test_recipe_layout_gives_stand_alones_run(matrix, case):
    name, layout = case
    reference, got = matrix[(name, "stand_alone")], matrix[case]
    assert not isinstance(reference, str), reference
    assert not isinstance(got, str), got
    assert reference["steps"] == math.ceil(TRAIN / BATCH) and reference["epoch"] == pytest.approx(1.0)
    assert (got["steps"], got["epoch"]) == (reference["steps"], reference["epoch"])
    assert close(got["losses"][0], reference["losses"][0], 1e-5), (got["losses"], reference["losses"])
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == len(reference[key]) == reference["steps"], key
        assert all(close(a, b, 1e-4) for a, b in zip(got[key], reference[key])), (key, got[key], reference[key])
    assert close(got["eval_loss"], reference["eval_loss"], 1e-4), (got["eval_loss"], reference["eval_loss"])
    assert got["tokens"] == reference["tokens"] > 0
    assert close(got["flos"], reference["flos"], 1e-6), (got["flos"], reference["flos"])
    assert got["saved"] == reference["saved"]
    if reference["classifier"] is not None:  # a new head: initialised as stand-alone's, trained alike
        assert close(got["classifier"], reference["classifier"], 1e-4), (got["classifier"], reference["classifier"])
    assert_same_answers(got["samples"], reference["samples"])


def assert_same_answers(got, expected) -> None:
    """The pipeline's answers: the same texts, or the same labels with scores to 1e-4."""
    assert got is not None and expected is not None and len(got) == len(expected) == 1
    if isinstance(expected[0], str):
        assert got == expected
        return
    flat = [item for answer in (got, expected) for item in (answer[0] if isinstance(answer[0], list) else answer)]
    half = len(flat) // 2
    assert [item.get("label", item.get("token_str")) for item in flat[:half]] == \
        [item.get("label", item.get("token_str")) for item in flat[half:]]
    assert all(close(a["score"], b["score"], 1e-4) for a, b in zip(flat[:half], flat[half:]))


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_layouts_a_recipe_cannot_run_are_refused_before_training(matrix, refusal, tmp_path):
    name, layout, needle = refusal
    got = matrix[(name, layout)]
    assert isinstance(got, str) and got.startswith("ConfigError") and needle in got, got


def test_refused_runs_wrote_nothing(matrix):
    for name, layout, _ in REFUSALS:
        assert not (matrix["work"] / f"{name}-{layout}" / "trainer_state.json").exists(), (name, layout)


def test_auto_parallel_runs_on_the_cpu(matrix):
    """``--parallel_mode auto_parallel`` without GPUs or size hints plans one process and runs it stand-alone (it
    planned a one-rank layout that then asked for torchrun's environment)."""
    got = matrix[(AUTO_PARALLEL_RECIPE, "stand_alone")]
    assert not isinstance(got, str), got
    assert got["layout"].startswith("1 process (stand_alone): dp=1 tp=1 pp=1")


def test_eval_mode_under_a_layout_evaluates_and_predicts_from_the_evaluated_model(matrix):
    """``--run_mode eval`` under tp2 of a saved adapter: stand-alone's final evaluation, and the pipeline's answers
    from the model evaluated (it looked for a model in the new output_dir: "no config.json")."""
    reference, got = matrix[("bert_classification_lora", "stand_alone")], matrix["eval-tp2"]
    assert not isinstance(got, str), got
    assert close(got["eval_loss"], reference["eval_loss"], 1e-5)
    assert_same_answers(got["samples"], reference["samples"])


def test_a_saved_adapter_generates_in_a_worker_pool(matrix, tmp_path):
    """The LoRA recipe's saved adapter predicted under tp2 (a pool of generation workers loads its base, then the
    adapter), and the same adapter as a peft model object in a parallel pipeline: stand-alone's tokens (both were
    refused: "has no config.json", "is not a model")."""
    from mindformers_py import pipeline
    from mindformers_py.adapters.apply import from_pretrained_with_adapter
    from mindformers_py.auto import AutoModelForCausalLM
    from mindformers_py.parallel import ParallelConfig
    from mindformers_py.recipes import load_recipe, run_recipe

    saved = matrix["work"] / "gpt_lora-stand_alone"
    expected = matrix[("gpt_lora", "stand_alone")]["samples"]
    results = run_recipe(load_recipe(saved / "run_config.yaml"),
                         ["--run_mode", "predict", "--model.name_or_path", str(saved), "--output_dir",
                          str(tmp_path / "predict"), *LAYOUTS["tp2"]])
    assert results["samples"] == expected
    model = from_pretrained_with_adapter(AutoModelForCausalLM, saved)
    prompt = RECIPES["gpt_lora"].prompt
    with pipeline("text-generation", model=model, tokenizer=str(saved),
                  parallel_config=ParallelConfig(parallel_mode="semi_auto_parallel", model_parallel=2)) as pooled:
        got = pooled(prompt, max_new_tokens=4, do_sample=False)
    assert got[0]["generated_text"] == expected[0]
