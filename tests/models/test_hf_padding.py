"""Padding as transformers treats it (issue 37), on the same weights as transformers' own models: the padding token's
embedding row (``padding_idx``: zero at init, no gradient) in the Llama-flavoured and BERT families, and right-padded
batches, whose padding positions see their row's real tokens (not themselves) and from which ``generate`` continues
as transformers does."""

from __future__ import annotations

import pytest
import torch
import transformers

import mindformers_py as mf
from support.bert_models import padded_batch, tiny_bert_config, tiny_bert_model
from support.hf_models import tiny_hf_config, tiny_hf_model
from mindformers_py.models.gpt import convert_gpt

KINDS = ["llama", "mistral", "qwen2", "mixtral", "gpt2"]


def _ours(hf):
    """Our causal LM holding ``hf``'s weights."""
    ours = mf.AutoModelForCausalLM.from_config(hf.config)
    ours.load_state_dict(convert_gpt.state_dict_from_hf(hf.state_dict(), ours.config))
    return ours.train(hf.training)


def _right_padded(lengths=(7, 4, 2), seed=0, pad_as_text=False):
    """Right-padded rows (pad id 0). ``pad_as_text`` also starts each row with the pad id as a real token, as text
    holds a tokenizer's end-of-text token when it is also the pad token (``tokenizer.pad_token =
    tokenizer.eos_token``, packed documents separated by it): only there does the pad row get a gradient."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 128, (len(lengths), width), generator=g).masked_fill(mask == 0, 0)
    if pad_as_text:
        ids[:, 0] = 0
    return ids, mask


# -- 4. padding_idx ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "bert", "roberta"])
def test_the_pad_row_is_zero_at_init_as_in_transformers(kind):
    config = tiny_bert_config(kind) if kind in ("bert", "roberta") else tiny_hf_config(kind)
    auto = "AutoModelForMaskedLM" if kind in ("bert", "roberta") else "AutoModelForCausalLM"
    theirs = getattr(transformers, auto).from_config(config).get_input_embeddings()
    ours = getattr(mf, auto).from_config(config).get_input_embeddings()
    assert ours.padding_idx == theirs.padding_idx
    if kind != "gpt2":  # GPT-2's table has no padding row, in transformers and here
        assert ours.padding_idx == config.pad_token_id and not ours.weight[config.pad_token_id].any()
    if kind == "roberta":  # RoBERTa's padding tokens sit at position pad_token_id, a zero row too
        positions = mf.AutoModelForMaskedLM.from_config(config).base_model.embed_positions
        assert positions.padding_idx == 1 and not positions.weight[1].any()


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_the_pad_row_gets_no_gradient_and_every_gradient_matches_transformers(kind, tmp_path):
    if kind == "bert":  # the bare encoder: a masked-LM head tied to the table would give the pad row a gradient
        hf = tiny_bert_model("bert", "base").train()
        hf.save_pretrained(tmp_path / "bert")
        ours = mf.AutoModel.from_pretrained(tmp_path / "bert").train()
        batch = padded_batch("bert", pairs=False)
        weights = torch.randn(32, generator=torch.Generator().manual_seed(0))
        loss = lambda model: (model(**batch).last_hidden_state * weights).sum()  # noqa: E731
    else:
        hf = tiny_hf_model(kind).train()
        ours = _ours(hf)
        ids, mask = _right_padded(pad_as_text=True)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        loss = lambda model: model(**batch).loss  # noqa: E731
    for model in (hf, ours):
        loss(model).backward()
    theirs, mine = hf.get_input_embeddings().weight.grad, ours.get_input_embeddings().weight.grad
    assert not mine[0].any() and not theirs[0].any()  # pad id 0 in both families' tiny configs
    assert (mine - theirs).abs().max() <= 1e-5


def test_a_padded_trainer_run_gives_transformers_gradient_norms(tmp_path):
    """The issue's report: step 2's gradient norm 2.215 against transformers' 1.448 while the pad row learned."""
    hf = tiny_hf_model("llama").train()
    ours = _ours(hf)
    ids, mask = _right_padded((8, 5, 3, 8), seed=1, pad_as_text=True)
    rows = [{"input_ids": i.tolist(), "attention_mask": m.tolist(), "labels": i.masked_fill(m == 0, -100).tolist()}
            for i, m in zip(ids, mask)]
    common = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[],
                  disable_tqdm=True, save_strategy="no", seed=3)
    runs = [transformers.Trainer(model=hf, train_dataset=rows, args=transformers.TrainingArguments(
                output_dir=str(tmp_path / "hf"), use_cpu=True, **common)),
            mf.Trainer(model=ours, train_dataset=rows, args=mf.TrainingArguments(
                output_dir=str(tmp_path / "ours"), bf16=False, **common))]
    pad_row = ours.get_input_embeddings().weight[0].detach().clone()
    norms = []
    for trainer in runs:
        trainer.train()
        norms.append([h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert torch.equal(ours.get_input_embeddings().weight[0], pad_row)  # AdamW without weight decay: untouched


# -- 13. right-padded batches --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_right_padded_batches_match_transformers_at_every_position_and_in_generate(kind):
    hf = tiny_hf_model(kind)
    ours = _ours(hf)
    for seed in (0, 1, 2):
        ids, mask = _right_padded(seed=seed)
        with torch.no_grad():
            assert (ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits).abs().max() <= 1e-4
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
