"""Bytes saved for backward per token: our GPT (Llama flavour) against transformers' ``LlamaForCausalLM`` on the same
weights and batch, measured on the CPU with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves during the forward pass of one training step (loss included) is recorded once per
storage (two ops saving the same tensor, or views of it, count once); the weights themselves (and views of them) are
not activations and are left out. Each saved tensor is charged to the innermost module whose forward was running
(``loss`` when outside every module), grouped by the module's role (``q_proj``, ``mlp.down_proj``, ``norm``,
``lm_head``, ...), so the table says where one side saves more. The default shape is Llama 3.2 1B's (hidden 2048, 32
query / 8 key-value heads, MLP 8192, 128,256-word vocabulary, tied embeddings) with 2 of its 16 layers, one row of
256 tokens; ``--bf16`` runs the step under bf16 autocast, as training on a GPU does.

Attention kernels differ between devices (on the CPU ours takes an explicit path for short sequences under bf16
autocast, and torch's CPU flash kernel saves fp32 copies there), so the attention core (``attention core``) is shown
apart and the totals are given with and without it. The last lines scale the per-layer and per-token parts to the
whole model and the issue's GPU step (16 layers, batch 4 x 2048).

    python benchmarks/saved_activations.py                 # fp32
    python benchmarks/saved_activations.py --bf16          # bf16 autocast
    python benchmarks/saved_activations.py --layers 2 --seq 512 --fused-loss
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))

import mindformers_py as mf  # noqa: E402
from mindformers_py.models.gpt.convert_gpt import config_to_hf, state_dict_to_hf  # noqa: E402

ATTENTION_CORE = "attention core"
WEIGHT_COPIES = "weight copies (autocast)"


def llama_1b(layers: int) -> mf.GPTConfig:
    return mf.AutoConfig.from_pretrained("llama_1b", num_hidden_layers=layers)


class SavedBytes:
    """Records the bytes of every tensor saved for backward while active, charged to the running module's role."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.seen: set[int] = set()
        self.by_role: dict[str, int] = collections.Counter()
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # Autocast's bf16 copies of the weights are saved too: per step, not per token. Told apart by shape and
        # dtype: a 2-D tensor of a weight's shape (or its transpose) in another dtype than the weights'; callers
        # keep the token count off the weights' sizes (a flattened (tokens, vocabulary) activation would match).
        self.weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        self.weight_shapes |= {shape[::-1] for shape in self.weight_shapes}
        self.weight_dtypes = {p.dtype for p in model.parameters()}
        self.handles = []

    @staticmethod
    def _role(name: str) -> str:
        """``model.layers.3.self_attn.q_proj`` -> ``attn.q_proj``: the same role in every layer."""
        if re.fullmatch(r"model\.layers\.\d+", name):
            return "layer (residuals)"
        role = re.sub(r"^model\.(layers\.\d+\.)?", "", name)
        return re.sub(r"^self_attn(\.|$)", r"attn\1", role)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.weights and ptr not in self.seen and storage.nbytes():
            self.seen.add(ptr)
            copy = (tensor.dim() == 2 and tuple(tensor.shape) in self.weight_shapes
                    and tensor.dtype not in self.weight_dtypes)
            role = WEIGHT_COPIES if copy else self.stack[-1] if self.stack else "loss"
            self.by_role[role] += storage.nbytes()
        return tensor

    def _leave(self) -> None:  # a forward hook must return None (anything else replaces the output)
        self.stack.pop()

    @contextlib.contextmanager
    def recording(self):
        for name, module in self.model.named_modules():
            if not name:
                continue
            role = self._role(name)
            self.handles.append(module.register_forward_pre_hook(lambda m, a, r=role: self.stack.append(r)))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for handle in self.handles:
                handle.remove()


def measure(model: torch.nn.Module, batch: dict, bf16: bool, loss_fn=None, device: str = "cpu") -> dict[str, int]:
    """Bytes saved per role in one forward (+ loss) of ``model`` on ``batch`` (on ``device``); runs the backward
    too, so the step is a real one."""
    model.train()
    recorder = SavedBytes(model)
    _mark_attention_core(model, recorder)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)
    with recorder.recording(), autocast:
        loss = loss_fn(batch) if loss_fn is not None else model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return dict(recorder.by_role)


def _mark_attention_core(model: torch.nn.Module, recorder: SavedBytes) -> None:
    """Charge the attention core (softmax(qkᵀ)v) to its own role on both sides: ours is ``Attention.core``;
    transformers' is the ``attention_interface`` its attention modules call (patched for the step)."""
    from mindformers_py.layers.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            core = module.core

            def wrapped(*args, _core=core, **kwargs):
                recorder.stack.append(ATTENTION_CORE)
                try:
                    return _core(*args, **kwargs)
                finally:
                    recorder.stack.pop()

            module.core = wrapped
    if isinstance(model, transformers.PreTrainedModel) and not isinstance(model, mf.GPTForCausalLM):
        from transformers.models.llama import modeling_llama

        interfaces = modeling_llama.ALL_ATTENTION_FUNCTIONS
        sdpa = interfaces["sdpa"]

        def core(*args, **kwargs):
            recorder.stack.append(ATTENTION_CORE)
            try:
                return sdpa(*args, **kwargs)
            finally:
                recorder.stack.pop()

        interfaces["sdpa"] = core
        recorder.handles.append(_Restore(lambda: interfaces.__setitem__("sdpa", sdpa)))


class _Restore:
    def __init__(self, undo) -> None:
        self.remove = undo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (as a GPU step)")
    parser.add_argument("--fused-loss", action="store_true",
                        help="also ours with the fused linear cross-entropy (TrainingArguments.fused_loss)")
    opts = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    config = llama_1b(opts.layers)
    config.attention_dropout = 0.0
    torch.manual_seed(0)
    ours = mf.AutoModelForCausalLM.from_config(config)
    theirs = transformers.LlamaForCausalLM(config_to_hf(config))
    missing, unexpected = theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), config), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied head
    ids = torch.randint(0, config.vocab_size, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    tokens = ids.numel()
    sides = {"ours": measure(ours, batch, opts.bf16), "transformers": measure(theirs, batch, opts.bf16)}
    if opts.fused_loss:
        from mindformers_py.trainer.fused_loss import FusedCausalLMLoss

        fused = FusedCausalLMLoss(ours.base_model, ours.lm_head)
        sides["ours, fused loss"] = measure(ours, batch, opts.bf16, loss_fn=fused)
    report(sides, tokens, opts, config)


def report(sides: dict[str, dict[str, int]], tokens: int, opts: argparse.Namespace, config) -> None:
    names = list(sides)
    copies = {n: s.pop(WEIGHT_COPIES, 0) for n, s in sides.items()}
    roles = sorted({r for s in sides.values() for r in s}, key=lambda r: -max(s.get(r, 0) for s in sides.values()))
    print(f"saved for backward, bytes per token: Llama-3.2-1B shape with {opts.layers} layers, {opts.batch} x "
          f"{opts.seq} tokens, {'bf16 autocast' if opts.bf16 else 'fp32'}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    header = f"{'role':28}" + "".join(f"{n:>18}" for n in names)
    print(header)
    print("-" * len(header))
    for role in roles:
        print(f"{role:28}" + "".join(f"{sides[n].get(role, 0) / tokens:18,.0f}" for n in names))
    print("-" * len(header))
    totals = {n: sum(s.values()) for n, s in sides.items()}
    bare = {n: totals[n] - sides[n].get(ATTENTION_CORE, 0) for n in names}
    print(f"{'total':28}" + "".join(f"{totals[n] / tokens:18,.0f}" for n in names))
    print(f"{'total without attention core':28}" + "".join(f"{bare[n] / tokens:18,.0f}" for n in names))
    if any(copies.values()):
        print(f"{'+ bf16 weight copies (MiB)':28}" + "".join(f"{copies[n] / 2**20:18,.1f}" for n in names)
              + "   (per step, not per token)")
    reference = "transformers"
    for n in names:
        if n != reference:
            print(f"{n} / {reference}: {totals[n] / totals[reference]:.3f} (without the attention core "
                  f"{bare[n] / bare[reference]:.3f})")
    # Scale to the step: the per-layer roles times 16 / layers, the rest (embedding, final norm, head, loss)
    # as is, per token, times 4 x 2048 tokens; the attention core left out (its kernels differ between devices).
    full_layers, step_tokens = 16, 4 * 2048
    for n in names:
        per_layer = sum(v for r, v in sides[n].items() if _per_layer(r) and r != ATTENTION_CORE) / opts.layers
        rest = bare[n] - per_layer * opts.layers
        step = (per_layer * full_layers + rest) / tokens * step_tokens
        print(f"{n}: {step / 2**30:.2f} GiB saved for a 16-layer step of 4 x 2048 tokens, attention core and weight "
              "copies aside (scaled from this run)")


def _per_layer(role: str) -> bool:
    return role.startswith(("attn", "mlp", "input_layernorm", "post_attention_layernorm", "layer ", "dropout")) \
        or role == ATTENTION_CORE


if __name__ == "__main__":
    main()
