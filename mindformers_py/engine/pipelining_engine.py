"""The training engine for layouts with pipeline stages (``pipeline_stage > 1``), on the Engine seam.

It is the :class:`~.distributed.DistributedEngine` (mesh, data/tensor/sequence/vocabulary parallelism,
ZeRO, recompute, DCP checkpoints, metric reduction) with the model cut into pipeline stages
(:mod:`mindformers_py.parallel.pipelining.schedule`): each rank keeps its stages, each stage is parallelized like a whole
model would be, and one optimizer step's forward and backward run through torch's pipeline schedule.

What the Trainer sees:

* ``prepare_model(model)`` returns the :class:`~mindformers_py.parallel.pipelining.schedule.PipelineParallel`
  (``model_wrapped``: it trains with
  :meth:`forward_backward` and evaluates when called), and cuts ``model`` itself down to this rank's stages in
  place, so the Trainer's "model" has exactly this rank's parameters under the full model's names: the optimizer,
  gradient clipping and the sharded (DCP) checkpoints work on it unchanged. Whole weights are consolidated from
  every stage when saved (``save_pretrained``), so ``from_pretrained`` loads a pipeline run's output.
* The loss is the Trainer's (its ``compute_loss``, a user's override or ``compute_loss_func``), computed on the
  last stage for each pipeline micro-batch from the outputs the stages computed, through the same loss path as
  every engine (:mod:`.step_loss`: global item count, share, data-parallel rescale), so loss curves match
  ``stand_alone`` for every task head. A user's loss that cannot run there is refused before training
  (:meth:`PipeliningEngine.check_loss`).
* Checkpoints hold the sharded state (``dcp/``), which resumes under any layout, stand-alone included, and the
  whole weights. A tied embedding the first and last stage both hold is one weight to the other layouts: a
  checkpoint written without pipeline stages gives the last stage's copy (and its optimizer state) the embedding's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..adapters.apply import adapted_model, is_peft_model, refuse_prompt_learning
from ..errors import ConfigError
from ..parallel.layout import DDP_ZERO1, Layout
from ..parallel.pipelining.schedule import PipelineParallel, build_pipeline
from ..parallel.pipelining.stages import carried_names
from ..checkpoint.safetensors_io import load_state_dict
from .args import EngineArguments
from .distributed import DistributedEngine, global_grad_norm
from .optim import parameter_group_names
from .step_loss import LossFn, TrainingLoss


class PipeliningEngine(DistributedEngine):
    """Pipeline parallelism (with any data/tensor parallelism, ZeRO and recompute) on torch.distributed.

    Attributes (beyond :class:`DistributedEngine`'s):
        pipeline: this rank's :class:`~mindformers_py.parallel.pipelining.schedule.PipelineParallel` (after :meth:`prepare_model`).
    """

    runs_pipeline_stages = True
    supports_model_fused_loss = False  # the schedule takes the loss from the last stage's logits

    def __init__(self, layout: Layout, args: EngineArguments) -> None:
        super().__init__(layout, args)
        self.pipeline: PipelineParallel | None = None
        self._model_name = ""

    def prepare_model(self, model: nn.Module, task: Any = None) -> PipelineParallel:
        """Cut ``model`` into stages computing ``task`` (the Trainer's; None: the model's own), keep and parallelize
        this rank's, and cut ``model`` down to them in place; returns the pipeline, which the Trainer calls to train
        and evaluate. Every rank must build the same model."""
        config = self.layout
        if self.context is not None:
            self.context.task = task
        if config.data_parallel_engine == DDP_ZERO1:
            # torch's pipeline stages drive DDP-class and FSDP2/replicate modules only, not composable DDP.
            raise ConfigError(
                f"optimizer_shard=1 is not supported with pipeline_stage={config.pp} (ZeRO-1 runs on composable DDP, "
                "which torch's pipeline schedules cannot drive); choose one of: 0, 2, 3"
            )
        refuse_prompt_learning(model, f"pipeline_stage={config.pp}")
        self._optimizer_names = parameter_group_names(model)  # the whole model's, before it is cut into stages
        self._note_sequences(adapted_model(model), task)
        self._model_name = type(model).__name__
        # A peft model's adapters live in its base model, which is what the stages are cut from.
        self.pipeline = build_pipeline(adapted_model(model), config, self.mesh, self.device,
                                       parallelize=lambda part: self.parallelize(part, stage=part.pp_rank), task=task)
        if self.context is not None:
            self.context.prepare(model)
        return self.pipeline

    def check_loss(self, loss: TrainingLoss) -> None:
        """Refuse a user's loss (an overridden ``compute_loss`` or a ``compute_loss_func``) for a model whose stages
        carry state besides the hidden states (an MoE model's router statistics): the last stage cannot give it
        the whole model's outputs (router logits, auxiliary loss) that such a loss may read."""
        if loss.override is not None and self.pipeline is not None and self.pipeline.carries_state:
            carried = ", ".join(carried_names(self.pipeline.model_parts[-1]))
            raise ConfigError(
                f"{loss.override} cannot run under pipeline_stage={self.layout.pp}: "
                f"{self._model_name} carries {carried} between stages, so the last stage does not have the whole "
                "model's outputs to give it; use pipeline_stage=1 or the model's own loss")

    def forward_backward(self, model: nn.Module, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: torch.Tensor | None, loss_fn: LossFn | TrainingLoss,
                         real_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Forward and backward of this rank's gradient-accumulation batches through the pipeline schedule (each
        split into ``micro_batch_num`` pipeline micro-batches), the last stage computing ``loss_fn`` on each of
        them through :meth:`step_loss`. ``num_items_in_batch`` is the item count of the whole global batch;
        returns the backpropagated loss, whose mean over the data-parallel ranks is the global step loss. A batch
        the micro-batches do not divide (an epoch's last) is padded, and padding rows (``real_rows``) add nothing
        (:meth:`PipelineParallel.step`)."""
        if not isinstance(model, PipelineParallel):
            raise TypeError("PipeliningEngine.forward_backward runs the PipelineParallel returned by prepare_model")
        step = self.step_loss(loss_fn, num_items_in_batch, len(micro_batches) * model.micro_batches)
        batches = [self.to_device(batch) for batch in micro_batches]
        with self.autocast(), self.context_sharded():
            return model.forward_backward(batches, loss_fn=step, real_rows=real_rows)

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm over every stage's (and shard's) gradients to ``max_norm``, counting a
        tied embedding once although the first and last stage both hold it; returns the norm before clipping."""
        duplicates = set(self.pipeline.tied_copy_names) if self.pipeline is not None else set()
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        total = global_grad_norm([g for name, g in named if name not in duplicates], self.mesh, self.device)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for _, grad in named:
                    grad.mul_(coef)
        return total

    def load_weights(self, model: nn.Module, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """Load this rank's stages from whole safetensors weights: the other stages' tensors are skipped, and a
        tied head absent from the file (as ``save_pretrained`` writes it) takes the embedding it is tied to. A peft
        model loads its adapter (each rank its stages' tensors)."""
        if is_peft_model(model):
            return super().load_weights(model, folder, state)
        state = load_state_dict(folder) if state is None else dict(state)
        own = set(model.state_dict())
        tied = getattr(model, "_tied_weights_keys", None) or {}
        if getattr(model.config, "tie_word_embeddings", False) and isinstance(tied, Mapping):
            for alias, source in tied.items():
                if alias in own and alias not in state and source in state:
                    state[alias] = state[source]
        super().load_weights(model, folder, {k: v for k, v in state.items() if k in own})

