"""A peft adapter's training checkpoint resumes under every layout pair, on stand-alone's curve: saved stand-alone,
under dp2 + ZeRO-3, tp2 or pp2, resumed under each of the others (the adapter, its AdamW state, the scheduler). A
GPT-2-flavour model (its head tied to the embedding, which a pipeline's last stage holds a copy of) with LoRA, and a
BERT classifier whose new head peft trains whole (``modules_to_save``). Failed before: a pp2 checkpoint lacked the
tied head that the other layouts' peft models ask for, and a stand-alone checkpoint's whole optimizer state did not
fit a pipeline stage's half of the adapter.

One 2-process job saves under the three layouts and resumes every pair among them; the stand-alone saves and
resumes run in the test process."""

from __future__ import annotations

import pytest
import torch

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.parallel import ParallelConfig

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 64, 16, 4, 3, 2
RTOL = 1e-4
LAYOUTS = ("stand_alone", "zero3", "tp2", "pp2")
FAMILIES = ("gpt", "bert")
LORA = {"gpt": {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                "init_lora_weights": False},
        "bert": {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                 "init_lora_weights": False}}


def model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "bert":
        return mf.BertForSequenceClassification(mf.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    return mf.GPTForCausalLM(mf.GPTConfig(flavour="gpt2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=True,
                                          embedding_dropout=0.0, attention_dropout=0.0, hidden_dropout=0.0))


def data(family: str) -> list[dict]:
    ids = torch.randint(1, VOCAB, (4 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if family == "bert":
        return [{"input_ids": row.tolist(), "labels": int(row[0]) % 3} for row in ids]
    return [{"input_ids": row.tolist()} for row in ids]


def layout(name: str) -> ParallelConfig:
    sizes = {"zero3": dict(data_parallel=2, optimizer_shard=3), "tp2": dict(model_parallel=2),
             "pp2": dict(pipeline_stage=2, micro_batch_num=2), "stand_alone": {}}[name]
    return ParallelConfig(parallel_mode="stand_alone" if name == "stand_alone" else "semi_auto_parallel", **sizes)


def train(family: str, name: str, root: str, resume_from: str | None = None) -> list[float]:
    """The logged losses under layout ``name``; saving at step 2, or resuming from layout ``resume_from``'s save."""
    from transformers import default_data_collator

    parallel = layout(name)
    out = f"{root}/{family}/{name}" + (f"_from_{resume_from}" if resume_from else "")
    saving = {"save_strategy": "steps", "save_steps": SAVE_AT} if resume_from is None else {"save_strategy": "no"}
    args = mf.TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                                learning_rate=1e-2, max_steps=STEPS, logging_steps=1, use_cpu=True,
                                parallel_config=parallel, report_to=[], disable_tqdm=True, seed=3, bf16=False, **saving)
    trainer = mf.Trainer(model=model(family), args=args, train_dataset=data(family), peft_config=LORA[family],
                         data_collator=default_data_collator if family == "bert" else None)
    checkpoint = f"{root}/{family}/{resume_from}/checkpoint-{SAVE_AT}" if resume_from else None
    trainer.train(resume_from_checkpoint=checkpoint)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def attempt(*args, **kwargs) -> list[float] | str:
    """:func:`train`'s losses, or its error's first line (each pair is reported on its own)."""
    try:
        return train(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure of one pair
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _worker(rank, world_size, root):
    multi = [name for name in LAYOUTS if name != "stand_alone"]
    out = {(family, name, None): attempt(family, name, root) for family in FAMILIES for name in multi}
    for family in FAMILIES:
        for saved in LAYOUTS:
            for name in multi:
                if name != saved:
                    out[(family, name, saved)] = attempt(family, name, root, resume_from=saved)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("adapter_resume"))
    results = {(family, "stand_alone", None): train(family, "stand_alone", root) for family in FAMILIES}
    results.update(run_workers(_worker, 2, root)[0])
    for family in FAMILIES:
        for saved in LAYOUTS[1:]:
            results[(family, "stand_alone", saved)] = attempt(family, "stand_alone", root, resume_from=saved)
    return results


CASES = [(family, name, saved) for family in FAMILIES for saved in (None, *LAYOUTS) for name in LAYOUTS
         if name != saved and not (saved is None and name == "stand_alone")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}" + (f"-from-{c[2]}" if c[2] else ""))
def test_adapter_checkpoint_resumes_on_the_stand_alone_curve(runs, case):
    reference = runs[(case[0], "stand_alone", None)]
    got = runs[case]
    assert not isinstance(got, str), got
    assert len(reference) == STEPS and len(got) == STEPS
    assert got == pytest.approx(reference, rel=RTOL), case
