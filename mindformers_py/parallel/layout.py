"""``Layout``: a :class:`~.config.ParallelConfig` resolved for one run, frozen.

:class:`~.config.ParallelConfig` is what the user writes (MindFormers' field names, their aliases, strings from the
CLI); :meth:`ParallelConfig.resolve <.config.ParallelConfig.resolve>` checks it once against the run (the world size,
the model, the batch) and returns a :class:`Layout`: the degrees applied in that mode (``tp``, not
``model_parallel``: 1 in ``stand_alone`` whatever the YAML says), the ZeRO stage and the engine that serves data
parallelism, the mesh's shape and dimension names, the recompute policy. Everything downstream (the engines, the
mesh, :func:`~.parallelize.parallelize`, parallel inference, the generation pool) takes a ``Layout`` and never checks
it again; a process that receives one (a relaunched worker) reads it with :meth:`Layout.from_dict`.

:meth:`Layout.of` is the one place the user's size fields become degrees (torchtitan keeps the same split:
``Parallelism`` holds the documented fields, ``ParallelDims`` the resolved degrees and the mesh).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .context.checks import default_ulysses_degree
from .recompute_config import RecomputeConfig

# What serves data parallelism (see mindformers_py.parallel.data): nothing (one data-parallel rank), FSDP2's
# replicate (stage 0), DDP + ZeroRedundancyOptimizer (stage 1 without tensor parallelism), FSDP2 (stages 2/3).
NONE, REPLICATE, DDP_ZERO1, FSDP = "none", "replicate", "ddp_zero1", "fsdp"
# Names understood by torch.distributed.pipelining.schedules.get_schedule_class.
TORCH_SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
# The world mesh's dimensions (torchtitan's order; sizes of 1 kept, so every dimension can always be named).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """A parallel layout resolved for one run: the degrees applied, checked once (see the module docstring).

    Frozen: assigning a field raises ``dataclasses.FrozenInstanceError``. Made by
    :meth:`ParallelConfig.resolve <.config.ParallelConfig.resolve>` (checked) or :meth:`of` (derived without the run's
    checks); sent to other processes as :meth:`to_dict` and read back with :meth:`from_dict`.
    """

    parallel_mode: str
    """The mode the run applies: ``"stand_alone"``, ``"data_parallel"`` or ``"semi_auto_parallel"`` (an
    ``auto_parallel`` config is planned into one of them before it resolves; :meth:`of` keeps it as given)."""
    world_size: int = 1
    """Processes the layout was checked against."""
    dp: int = 1
    """Data-parallel degree (``data_parallel``; 1 in ``stand_alone``)."""
    cp: int = 1
    """Context-parallel degree (``context_parallel``; 1 unless the layout applies: ``semi_auto_parallel``)."""
    tp: int = 1
    """Tensor-parallel degree (``model_parallel``; 1 unless the layout applies)."""
    pp: int = 1
    """Pipeline-parallel degree (``pipeline_stage``; 1 unless the layout applies)."""
    ep: int = 1
    """Expert-parallel degree (``expert_parallel``; 1 unless the layout applies); its ranks are borrowed from
    ``dp x cp``."""
    vpp: int = 1
    """Model chunks per pipeline rank (``virtual_pipeline_stages``; 1 without pipeline parallelism)."""
    micro_batches: int = 1
    """Pipeline micro-batches each data-parallel rank's batch is split into (``micro_batch_num``; 1 without
    pipeline parallelism)."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``."""
    context_parallel_algo: str = "ring"
    """How attention sees a sequence split over the ``cp`` ranks: ``"ring"``, ``"ulysses"`` or ``"hybrid"``."""
    cp_ulysses: int = 1
    """Ranks of each Ulysses (all-to-all) group: ``cp`` under ``ulysses``, ``ulysses_degree_in_cp`` (or its
    default) under ``hybrid``, 1 under ``ring`` or without context parallelism."""
    zero_stage: int = 0
    """ZeRO stage applied, 0..3 (0 when ``dp x cp`` is 1: those are the ranks that reduce gradients together)."""
    shard_size: int | None = None
    """FSDP shard-group size for ZeRO 2/3 (``optimizer_weight_shard_size``; None: all data-parallel ranks); below
    ``dp`` it means HSDP."""
    sequence_parallel: bool = False
    """Whether sequence parallelism is applied (``use_seq_parallel`` with ``tp > 1``)."""
    vocab_parallel: bool = False
    """Whether the vocabulary is sharded over the tensor-parallel ranks (``vocab_emb_dp=False`` with ``tp > 1``)."""
    frozen_head_sharded: bool = False
    """Whether a frozen output head is split by rows over the ``dp x cp`` ranks (``shard_frozen_head`` with more than
    one of them)."""
    use_seq_parallel: bool = False
    """What the user asked for sequence parallelism (said in :meth:`describe` when ``tp`` is 1 and it is ignored)."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recomputation (a copy of the config's: changing the config afterwards does not change it)."""
    plan_summary: str | None = field(default=None, compare=False)
    """Why the ``auto_parallel`` planner chose this layout, in one line (None for a layout the user gave)."""

    @classmethod
    def of(cls, config: Any, world_size: int = 1) -> Layout:
        """The degrees ``config`` (a :class:`~.config.ParallelConfig`) applies in its mode, without checking them
        against a run: the one place the user's size fields are read into degrees."""
        return cls.reading(config, world_size, copy.deepcopy(config.recompute))

    @classmethod
    def reading(cls, config: Any, world_size: int = 1, recompute: RecomputeConfig | None = None) -> Layout:
        """:meth:`of` for reading a degree and dropping the layout: ``recompute`` is kept as given (by default the
        config's own, not a copy). ``ParallelConfig``'s derived degrees (``config.tp``, ...) read it: the planner
        reads them some 40 times for each layout it estimates, and the copy was most of its time."""
        mode = config.parallel_mode
        distributed = mode != "stand_alone"
        applies = mode in ("semi_auto_parallel", "auto_parallel")
        dp = config.data_parallel if distributed else 1
        cp, tp, pp, ep = ((config.context_parallel, config.model_parallel, config.pipeline_stage,
                           config.expert_parallel) if applies else (1, 1, 1, 1))
        algo = config.context_parallel_algo
        if cp == 1 or algo == "ring":
            ulysses = 1
        elif algo == "ulysses":
            ulysses = cp
        else:
            ulysses = config.ulysses_degree_in_cp or default_ulysses_degree(cp)
        size = config.optimizer_weight_shard_size
        return cls(
            parallel_mode=mode, world_size=world_size, dp=dp, cp=cp, tp=tp, pp=pp, ep=ep,
            vpp=config.virtual_pipeline_stages if pp > 1 else 1,
            micro_batches=config.micro_batch_num if pp > 1 else 1,
            pipeline_schedule=config.pipeline_schedule, context_parallel_algo=algo, cp_ulysses=ulysses,
            zero_stage=config.optimizer_shard if dp * cp > 1 else 0,
            shard_size=None if size == -1 or size >= dp else size,
            sequence_parallel=config.use_seq_parallel and tp > 1, vocab_parallel=not config.vocab_emb_dp and tp > 1,
            frozen_head_sharded=config.shard_frozen_head and dp * cp > 1,
            use_seq_parallel=config.use_seq_parallel,
            recompute=config.recompute if recompute is None else recompute)

    # -- what the consumers read -------------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        """Whether the run uses torch.distributed (every mode except ``stand_alone``)."""
        return self.parallel_mode != "stand_alone"

    @property
    def cp_ring(self) -> int:
        """Ranks of each ring of the context parallelism applied (``cp / cp_ulysses``)."""
        return self.cp // self.cp_ulysses

    @property
    def data_parallel_engine(self) -> str:
        """What serves the data parallelism applied: ``"none"`` (one data-parallel rank), ``"replicate"`` (stage
        0), ``"ddp_zero1"`` (stage 1 without tensor or expert parallelism) or ``"fsdp"`` (stages 2/3, and stage 1
        under tensor or expert parallelism, where ZeroRedundancyOptimizer cannot update DTensor parameters)."""
        if self.dp * self.cp == 1:
            return NONE
        if self.zero_stage == 0:
            return REPLICATE
        if self.zero_stage == 1 and self.tp == 1 and self.ep == 1:
            return DDP_ZERO1
        return FSDP

    @property
    def torch_schedule_name(self) -> str:
        """``pipeline_schedule`` as named by ``torch.distributed.pipelining.schedules.get_schedule_class``."""
        return TORCH_SCHEDULE_NAMES[self.pipeline_schedule]

    def required_world_size(self) -> int:
        """Processes the degrees ask for: ``dp x cp x tp x pp``."""
        return self.dp * self.cp * self.tp * self.pp

    def mesh_sizes(self, shard_size: int | None = None) -> dict[str, int]:
        """Sizes of the world mesh's :data:`MESH_DIMS`. When FSDP2 shards the state (:attr:`data_parallel_engine`
        ``"fsdp"``), it shards over ``shard_size`` data-parallel ranks (default :attr:`shard_size`, else all of
        them); the other ``dp / shard_size`` are replicas (HSDP). Otherwise every data-parallel rank is a replica."""
        shard = 1
        if self.data_parallel_engine == FSDP:
            shard = shard_size or self.shard_size or self.dp
            if shard < 1 or self.dp % shard:
                raise ConfigError(f"optimizer shard size={shard_size} is not valid with data_parallel={self.dp}; "
                                  f"expected a divisor of {self.dp}")
        return {"pp": self.pp, "dp_replicate": self.dp // shard, "dp_shard": shard, "cp": self.cp, "tp": self.tp}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The world mesh's shape, in the order of :data:`MESH_DIMS` (:attr:`mesh_dim_names`)."""
        sizes = self.mesh_sizes()
        return tuple(sizes[d] for d in MESH_DIMS)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The world mesh's dimension names (:data:`MESH_DIMS`)."""
        return MESH_DIMS

    def describe(self) -> str:
        """The layout applied, in one line: ``dp=2 tp=1 pp=1 ep=1, ZeRO-3, recompute=full`` (then the pipeline
        schedule, sequence and vocabulary parallelism where they apply; ``cp=2 (ring)`` after ``dp`` with context
        parallelism). Runs print it at start."""
        cp = f" cp={self.cp} ({self.context_parallel_algo})" if self.cp > 1 else ""
        parts = [f"dp={self.dp}{cp} tp={self.tp} pp={self.pp} ep={self.ep}"]
        if self.pp > 1:
            chunks = f" x{self.vpp} chunks" if self.vpp > 1 else ""
            parts.append(f"{self.pipeline_schedule}{chunks} over {self.micro_batches} micro-batches")
        zero = f"ZeRO-{self.zero_stage}" if self.zero_stage else "no ZeRO"
        parts.append(zero + (f" (HSDP, shard groups of {self.shard_size})" if self.shard_size else ""))
        recompute = self.recompute
        mode = "off" if not recompute.enabled else recompute.recompute
        if recompute.enabled and recompute.recompute == "selective":
            mode += "(" + "+".join(recompute.select_recompute) + ")"
        if recompute.enabled and recompute.recompute_num_layers is not None:
            layers = recompute.recompute_num_layers
            mode += f" on {list(layers) if isinstance(layers, tuple) else layers} layer(s) per stage"
        parts.append(f"recompute={mode}")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        elif self.use_seq_parallel:  # asked for, not applied: said rather than silently ignored
            parts.append("use_seq_parallel ignored (it splits sequences over model_parallel > 1 ranks)")
        if self.vocab_parallel:
            parts.append("vocabulary sharded")
        if self.frozen_head_sharded:
            parts.append(f"frozen head split over {self.dp * self.cp} ranks")
        return ", ".join(parts)

    # -- sent to other processes -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON/YAML-safe; ``recompute`` as its section's dict), read back by :meth:`from_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["recompute"] = self.recompute.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """The layout :meth:`to_dict` wrote (in the process that resolved it): read, not checked again."""
        return cls(**{**data, "recompute": RecomputeConfig.coerce(data.get("recompute"), "recompute")})


__all__ = ["Layout", "MESH_DIMS", "NONE", "REPLICATE", "DDP_ZERO1", "FSDP", "TORCH_SCHEDULE_NAMES"]
