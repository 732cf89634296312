"""Mixture of experts: our MoE block against transformers' Mixtral block, and dense against MoE pretraining.

``block``: tokens/s of one MoE block, forward and forward+backward, ours (:class:`mindformers_py.layers.moe.layer.MoE`,
dropless) against transformers' ``MixtralSparseMoeBlock`` holding the same weights (outputs asserted equal), in
both of its expert implementations that run here: ``grouped_mm`` (what a loaded transformers model uses when
torch has the kernel) and ``eager`` (a loop over the experts that gathers each one's tokens); fp32, interleaved
runs, the median of each reported with the ratios. The default shape is Mixtral's routing (8 experts, top-2) at a
width a CPU runs in seconds.

``pretrain``: ``llama_tiny`` (dense SwiGLU MLP of 768) against ``gpt_moe_tiny`` (8 SwiGLU experts of 384, top-2:
the same matrix work per token, five times the MLP parameters) trained with the same recipe
(``tasks/gpt_moe/pretrain_tiny.yaml``: data, tokenizer, optimizer, schedule, seed) on the default corpus (the
Python standard library's source). Every ``--eval-every`` steps both models are scored on the same validation
blocks with the cross-entropy alone (``output_router_logits=False``: the router loss is a training device, not
part of the language model's quality); training time is this process's CPU time (steadier than wall time when
other jobs share the cores) and excludes those evaluations. Reported: validation loss at equal steps, and at equal
time (each run's loss at the last evaluation before the faster run's end).

    python benchmarks/bench_moe.py block                       # defaults: hidden 512, expert 1024, 4096 tokens, 1 thread
    python benchmarks/bench_moe.py block --threads 2 --repeats 9
    python benchmarks/bench_moe.py pretrain --steps 200        # both pretraining runs (an hour on 2 busy cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from mindformers_py.layers.moe.layer import MoE
from mindformers_py.layers.moe.config import MoEConfig

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


# -- block ---------------------------------------------------------------------------------------------------------


HF_IMPLEMENTATIONS = ("grouped_mm", "eager")


def make_blocks(hidden: int, ffn: int, experts: int, top_k: int) -> tuple[dict[str, torch.nn.Module], torch.nn.Module]:
    """transformers' Mixtral block with random weights (one per expert implementation, sharing them), and ours
    holding the same ones."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                                        num_experts_per_tok=top_k)
    config._experts_implementation = HF_IMPLEMENTATIONS[0]
    hf = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, hidden**-0.5)
    ours = MoE(hidden, ffn, MoEConfig(expert_num=experts, num_experts_chosen=top_k, routing_policy="dropless",
                                      router_dense_type="auto"), act="silu", gated=True)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    blocks = {HF_IMPLEMENTATIONS[0]: hf}
    for name in HF_IMPLEMENTATIONS[1:]:
        other = transformers.MixtralConfig(**config.to_dict())
        other._experts_implementation = name
        blocks[name] = MixtralSparseMoeBlock(other)
        blocks[name].load_state_dict(hf.state_dict())
    return blocks, ours


def _run(block: torch.nn.Module, x: torch.Tensor, backward: bool, clock=time.process_time) -> float:
    """Seconds of one pass on ``clock``: this process's CPU time by default, which other jobs on shared cores
    disturb less than wall time (with one thread the two agree on an idle machine)."""
    x = x.detach().requires_grad_(backward)
    start = clock()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    if backward:
        (out * out.detach()).sum().backward()  # a contiguous upstream gradient, as a real loss gives
    return clock() - start


def bench_block(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    hf, ours = make_blocks(args.hidden, args.ffn, args.experts, args.top_k)
    x = torch.randn(args.batch, args.tokens // args.batch, args.hidden)
    with torch.no_grad():
        diff = max((block(x) - ours(x)[0]).abs().max().item() for block in hf.values())
    assert diff <= 1e-4, diff
    print(f"MoE block: hidden {args.hidden}, {args.experts} experts of {args.ffn}, top-{args.top_k}, {args.tokens} tokens, "
          f"fp32, {args.threads} thread(s), CPU-time rates; max |ours - HF| = {diff:.1e}")
    blocks = {**{f"HF {name}": block for name, block in hf.items()}, "ours": ours}
    print(f"{'pass':<18}" + "".join(f"{name + ' tok/s':>20}" for name in blocks)
          + "".join(f"{'ours / HF ' + name:>22}" for name in hf))
    for backward in (False, True):
        times = {name: [] for name in blocks}
        for _ in range(args.warmup):
            for block in blocks.values():
                _run(block, x, backward)
        for _ in range(args.repeats):  # interleaved: every side sees the same machine load
            with torch.set_grad_enabled(backward):
                for name, block in blocks.items():
                    times[name].append(_run(block, x, backward))
        rates = {name: args.tokens / statistics.median(t) for name, t in times.items()}
        row = "forward+backward" if backward else "forward"
        print(f"{row:<18}" + "".join(f"{rates[name]:>20.0f}" for name in blocks)
              + "".join(f"{rates['ours'] / rates['HF ' + name]:>21.2f}x" for name in hf))


# -- pretrain ------------------------------------------------------------------------------------------------------


class HeldOutLoss(transformers.TrainerCallback):
    """Every ``every`` steps: the cross-entropy alone on fixed validation blocks, and the training CPU time so far
    (evaluation time excluded)."""

    def __init__(self, validation, every: int, batch: int) -> None:
        self.validation, self.every, self.batch = validation, every, batch
        self.points: list[tuple[int, float, float]] = []  # (step, training seconds, loss)
        self.paused = 0.0
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.process_time()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every and state.global_step != state.max_steps:
            return
        began = time.process_time()
        seconds = began - self.start - self.paused
        self.points.append((state.global_step, seconds, self.evaluate(model)))
        self.paused += time.process_time() - began

    @torch.no_grad()
    def evaluate(self, model) -> float:
        was = model.training
        model.eval()
        total = items = 0
        for start in range(0, len(self.validation), self.batch):
            ids = torch.tensor(self.validation[start:start + self.batch]["input_ids"], device=model.device)
            n = ids[:, 1:].numel()
            total += model(input_ids=ids, labels=ids, output_router_logits=False).loss.item() * n
            items += n
        model.train(was)
        return total / items


def pretrain(name: str, recipe: dict, args: argparse.Namespace) -> HeldOutLoss:
    from mindformers_py import AutoModelForCausalLM
    from mindformers_py.data.recipe_data import causal_lm_data
    from mindformers_py.recipes.runner import _load_tokenizer
    from mindformers_py.recipes.sections import DataSection, TokenizerSection, section_from_dict
    from mindformers_py.trainer import Trainer, TrainingArguments

    model_s = dict(recipe["model"])
    preset = model_s.pop("name_or_path")
    data_s = section_from_dict(DataSection, recipe["data"], "data")
    tokenizer = _load_tokenizer(section_from_dict(TokenizerSection, recipe["tokenizer"], "tokenizer"), data_s, preset)
    data = causal_lm_data(data_s, tokenizer, None)
    model_s.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    if name == "dense":
        model_s.update(moe_config=None, output_router_logits=False)
        preset = "llama_tiny"
    torch.manual_seed(recipe["training"]["seed"])
    model = AutoModelForCausalLM.from_pretrained(preset, **model_s)
    training = {**recipe["training"], "max_steps": args.steps, "eval_strategy": "no", "save_strategy": "no",
                "report_to": [], "disable_tqdm": True, "output_dir": f"{args.output_dir}/{name}",
                "overwrite_output_dir": True, "logging_steps": args.eval_every}
    clock = HeldOutLoss(data.validation, args.eval_every, recipe["training"]["per_device_eval_batch_size"])
    Trainer(model=model, args=TrainingArguments(**training), train_dataset=data.train, processing_class=tokenizer,
            callbacks=[clock]).train()
    active = sum(p.numel() for n, p in model.named_parameters()
                 if ".experts." not in n and "embed" not in n and "lm_head" not in n)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if experts:
        moe = model.config.moe
        active += experts * moe.num_experts_chosen // moe.expert_num
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"{active / 1e6:.2f} M active per token (without embeddings and head), "
          f"{clock.points[-1][1]:.0f} CPU s for {args.steps} steps")
    return clock


def bench_pretrain(args: argparse.Namespace) -> None:
    from mindformers_py.recipes import load_recipe

    torch.set_num_threads(args.threads)
    recipe = load_recipe(ROOT / "tasks" / "gpt_moe" / "pretrain_tiny.yaml")
    runs = {name: pretrain(name, recipe, args) for name in ("dense", "moe")}
    dense, moe = runs["dense"].points, runs["moe"].points
    print(f"{'step':>6}{'dense CPU s':>13}{'dense loss':>12}{'MoE CPU s':>11}{'MoE loss':>11}")
    for (step, ds, dl), (_, ms, ml) in zip(dense, moe):
        print(f"{step:>6}{ds:>13.0f}{dl:>12.4f}{ms:>11.0f}{ml:>11.4f}")
    budget = min(dense[-1][1], moe[-1][1])

    def at(points):
        done = [p for p in points if p[1] <= budget + 1e-9]
        return done[-1]

    (ds, _, dl), (ms, _, ml) = at(dense), at(moe)
    print(f"equal steps ({dense[-1][0]}): dense {dense[-1][2]:.4f}, MoE {moe[-1][2]:.4f} (MoE - dense = "
          f"{moe[-1][2] - dense[-1][2]:+.4f})")
    print(f"equal time ({budget:.0f} CPU s of training): dense {dl:.4f} (step {ds}), MoE {ml:.4f} (step {ms}) "
          f"(MoE - dense = {ml - dl:+.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    block = sub.add_parser("block", help="our MoE block against transformers' Mixtral block")
    block.add_argument("--hidden", type=int, default=512)
    block.add_argument("--ffn", type=int, default=1024, help="intermediate size of one expert")
    block.add_argument("--experts", type=int, default=8)
    block.add_argument("--top-k", type=int, default=2)
    block.add_argument("--tokens", type=int, default=4096)
    block.add_argument("--batch", type=int, default=8)
    block.add_argument("--threads", type=int, default=1)
    block.add_argument("--warmup", type=int, default=2)
    block.add_argument("--repeats", type=int, default=7)
    train = sub.add_parser("pretrain", help="dense llama_tiny against gpt_moe_tiny on the default corpus")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--eval-every", type=int, default=25)
    train.add_argument("--threads", type=int, default=2)
    train.add_argument("--output-dir", default="runs/bench_moe")
    args = parser.parse_args()
    bench_block(args) if args.command == "block" else bench_pretrain(args)


if __name__ == "__main__":
    main()
