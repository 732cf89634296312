"""``torch_compile=True`` compiles each transformer layer (``parallel/compile.py``): the compiled stack computes the
eager loss and gradients (decoder-only and encoder-decoder), one graph serves every layer, and through the Trainer the
model stays a plain module whose losses equal the eager run's, with the first step's time reported.

Dynamo captures the graphs and AOTAutograd traces forward and backward (``aot_eager`` backend: the decompositions and
the joint graph inductor would get, without waiting for its C++ code generation)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import mindformers_py as mf
from mindformers_py.parallel.compile import compile_layers
from mindformers_py.parallel.data import layer_modules

BACKEND = "aot_eager"


def gpt() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def t5() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = mf.T5ForConditionalGeneration(mf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                      num_decoder_layers=2, num_heads=4, dropout_rate=0.0))
    g = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(2, 64, (2, 10), generator=g),
                   "labels": torch.randint(2, 64, (2, 6), generator=g)}


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build, graphs", [(gpt, 1), (t5, 2)], ids=["gpt_llama", "t5"])
def test_compiled_layers_give_the_eager_loss_and_gradients_with_one_graph(build, graphs):
    eager, batch = build()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    layers = compile_layers(compiled, backend=BACKEND)
    assert len(layers) == len(layer_modules(eager)) >= 2 and type(compiled) is type(eager)  # the model stays plain
    expected_loss, expected = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # One graph per kind of layer, not per layer: the decoder-only stack one, T5 one for its encoder layers and one
    # for its decoder layers (with cross-attention).
    assert counters["stats"]["unique_graphs"] == graphs


def test_trainer_compiles_each_layer_and_trains_as_eager(tmp_path):
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(2)).tolist()]
    collate = lambda batch: {k: torch.tensor([r[k] for r in batch]) for k in batch[0]}  # noqa: E731

    def train(compile_: bool) -> mf.Trainer:
        model, _ = gpt()
        args = mf.TrainingArguments(output_dir=str(tmp_path / str(compile_)), per_device_train_batch_size=4, max_steps=3,
                                    logging_steps=1, learning_rate=1e-2, report_to=[], save_strategy="no",
                                    disable_tqdm=True, plot_loss_curve=False, use_cpu=True, bf16=False,
                                    torch_compile_backend=BACKEND if compile_ else None)
        trainer = mf.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
        trainer.train()
        return trainer

    torch._dynamo.reset()
    eager, compiled = train(False), train(True)
    assert compiled.args.torch_compile  # the backend alone turns it on, as in transformers
    assert type(compiled.model) is mf.GPTForCausalLM
    assert all(layer._compiled_call_impl is not None for layer in layer_modules(compiled.model))
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (eager, compiled)]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    # Eager RMSNorms run their hand-written backward, compiled ones autograd's ops: gradients equal to rounding, which
    # Adam (lr 1e-2) can turn into 1e-5 where a gradient is tiny; 1e-4 is 1% of one step.
    assert all(torch.allclose(p, q, atol=1e-4) for p, q in zip(eager.model.parameters(), compiled.model.parameters()))
    metrics = compiled.state.log_history[-1]
    assert metrics["train_first_step_runtime"] > 0
