"""The fine-tuning recipes' setups from Python with a peft model, under layouts the Trainer starts its own workers for:
a BERT classifier loaded from a checkpoint without its head (peft trains the new head whole, as the LoRA recipe
does) and a GPT-2 with a tied head, each with LoRA. Under tp2, pp2 and ZeRO-3 the workers train on stand-alone's
curve (losses and gradient norms) and the adapter comes back to this process (it raised "no weights" and brought
nothing back); the new head starts from stand-alone's values (it was never initialised under a layout); and under
dp2, ``evaluate`` on 7 samples and ``predict`` on 5 (sizes the ranks do not divide) give stand-alone's loss and
predictions, each sample once."""

from __future__ import annotations

import pytest
import torch

import mindformers_py as mf
from mindformers_py.parallel import ParallelConfig

VOCAB, SEQ, BATCH = 64, 12, 4
LORA = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
LAYOUTS = {"tp2": dict(model_parallel=2), "pp2": dict(pipeline_stage=2, micro_batch_num=2),
           "zero3": dict(data_parallel=2, optimizer_shard=3)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Pretrained folders without a task head: a BERT encoder (its classifier is new) and a GPT-2 LM."""
    folder = tmp_path_factory.mktemp("peft_bases")
    torch.manual_seed(0)
    mf.BertModel(mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, pad_token_id=0)).save_pretrained(folder / "bert")
    mf.GPTForCausalLM(mf.GPTConfig(flavour="gpt2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=32, embedding_dropout=0.0,
                                   attention_dropout=0.0, hidden_dropout=0.0)).save_pretrained(folder / "gpt")
    return folder


def rows(family: str, n: int, seed: int) -> list[dict]:
    """``n`` samples of varying length (padded per batch by the collator)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (int(torch.randint(5, SEQ + 1, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids[0] % 3} if family == "bert" else {"input_ids": ids})
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    length = max(len(r["input_ids"]) for r in batch)
    ids = torch.tensor([r["input_ids"] + [0] * (length - len(r["input_ids"])) for r in batch])
    mask = (torch.arange(length)[None] < torch.tensor([len(r["input_ids"]) for r in batch])[:, None]).long()
    if "labels" in batch[0]:
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["labels"] for r in batch])}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer(bases, family: str, out, parallel: ParallelConfig) -> mf.Trainer:
    torch.manual_seed(42)
    if family == "bert":
        model = mf.AutoModelForSequenceClassification.from_pretrained(bases / "bert", num_labels=3)
    else:
        model = mf.AutoModelForCausalLM.from_pretrained(bases / "gpt")
    args = mf.TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH // parallel.dp,
                                per_device_eval_batch_size=2, num_train_epochs=1, logging_steps=1, learning_rate=1e-2,
                                report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False,
                                parallel_config=parallel, overwrite_output_dir=True)
    return mf.Trainer(model=model, args=args, train_dataset=rows(family, 13, 1), eval_dataset=rows(family, 7, 2),
                      data_collator=collate, peft_config=LORA)


def curve(trainer: mf.Trainer) -> tuple[list[float], list[float]]:
    history = trainer.state.log_history
    return [h["loss"] for h in history if "loss" in h], [h["grad_norm"] for h in history if "grad_norm" in h]


def trained(trainer: mf.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()
            if "lora" in k or "modules_to_save" in k}


@pytest.fixture(scope="module")
def stand_alone(bases, tmp_path_factory):
    out = {}
    for family in ("bert", "gpt"):
        run = trainer(bases, family, tmp_path_factory.mktemp(f"{family}_sa"), ParallelConfig())
        initial = trained(run)
        run.train()
        out[family] = (run, initial)
    return out


@pytest.mark.parametrize("family, layout", [("bert", "tp2"), ("bert", "pp2"), ("bert", "zero3"), ("gpt", "pp2")])
def test_peft_trainer_under_a_layout_trains_and_brings_the_adapter_back(bases, stand_alone, tmp_path, family, layout):
    reference, initial = stand_alone[family]
    run = trainer(bases, family, tmp_path, ParallelConfig(parallel_mode="semi_auto_parallel", **LAYOUTS[layout]))
    assert all(torch.equal(v, initial[k]) for k, v in trained(run).items())  # the same start as stand-alone
    run.train()
    (losses, norms), (expected_losses, expected_norms) = curve(run), curve(reference)
    assert len(losses) == len(expected_losses) == 4  # 13 samples in batches of 4: the last batch holds one
    assert losses == pytest.approx(expected_losses, rel=1e-4) and norms == pytest.approx(expected_norms, rel=1e-4)
    got, expected = trained(run), trained(reference)
    assert set(got) == set(expected) and any("classifier" in k for k in got) == (family == "bert")
    for key, value in expected.items():
        assert not torch.equal(value, initial[key]) or "lora_B" not in key  # trained
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")  # AdamW: ~1e-2


def test_evaluate_and_predict_on_sizes_the_ranks_do_not_divide(bases, stand_alone, tmp_path):
    """dp2 from Python: 7 evaluation samples (batches of 2 x 2 ranks: the last global batch is 3, split 2 + 1) and 5
    to predict (the last is 1: one rank reads a padding row, which is dropped); the stand-alone model's weights."""
    reference = stand_alone["bert"][0]
    run = trainer(bases, "bert", tmp_path, ParallelConfig(parallel_mode="data_parallel", data_parallel=2))
    run.model.load_state_dict(reference.model.state_dict())
    expected_eval, expected = reference.evaluate(), reference.predict(rows("bert", 5, 3))
    assert run.evaluate()["eval_loss"] == pytest.approx(expected_eval["eval_loss"], rel=1e-5)
    got = run.predict(rows("bert", 5, 3))
    assert got.predictions.shape == expected.predictions.shape == (5, 3)
    torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(expected.predictions), rtol=1e-5,
                               atol=1e-6)
    assert got.label_ids.tolist() == expected.label_ids.tolist()
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-5)
