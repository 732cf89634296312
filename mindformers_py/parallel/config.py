"""Parallel configuration: ``ParallelConfig``, ``RecomputeConfig`` and ``MoEConfig``.

MindFormers' field names, read by the torch.distributed engine in :mod:`mindformers_py.parallel`. This module
only describes and checks a layout; it creates no process group and touches no weight, so every mistake is
reported before anything expensive starts.

Checking happens in two phases:

* construction (and :meth:`ParallelConfig.validate`) checks what the config says on its own: types, ranges,
  known modes and schedules, micro-batches against pipeline stages, expert parallel dividing data parallel;
* :meth:`ParallelConfig.resolve` checks the config against the run: the world size, a model config
  (heads, FFN size, vocabulary, layers and experts against the shard sizes) and the batch size
  (:mod:`.layout_checks`), and returns the frozen :class:`~.layout.Layout` the run reads from then on.

Values may come from Python, from a YAML section (:meth:`~_Section.from_dict`) or from CLI flags as strings
(``"true"``, ``"2"``, ``"full"``, ``"attention_core,mlp"``); strings are converted at construction.

MindFormers recompute options without a counterpart here are refused with a reason rather than accepted and
ignored: ``parallel_optimizer_comm_recompute`` is what ``optimizer_shard=3`` already does (FSDP2 re-gathers
parameters in backward), and ``mp_comm_recompute``/``recompute_slice_activation``/``select_comm_recompute``
tune MindSpore graph passes that torch's checkpointing has no switch for.

``RecomputeConfig`` lives in :mod:`.recompute_config`, ``MoEConfig`` in :mod:`.moe_config` and the shared section
machinery in :mod:`mindformers_py.utils.config_section`; all are re-exported here, so this module stays the import path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigError, invalid_choice
from ..utils.config_section import (_FALSE_STRINGS, _TRUE_STRINGS, _divisors, _prefixed, _require_int, _Section, _to_bool,
                          _to_choice, _to_int)

# RecomputeConfig, MoEConfig and their constants are re-exported so that ``mindformers_py.parallel.config``
# stays the one import path for every config section and its constants.
from ..layers.moe.config import ROUTING_POLICIES, ROUTING_POLICY_ALIASES, MoEConfig  # noqa: F401
from .recompute_config import RECOMPUTE_MODES, SELECT_RECOMPUTE_CHOICES, RecomputeConfig  # noqa: F401
from .context.checks import validate_context_layout
# The data-parallel engines' names and torch's schedule names are the Layout's; re-exported from here too.
from .layout import DDP_ZERO1, FSDP, NONE, REPLICATE, TORCH_SCHEDULE_NAMES, Layout  # noqa: F401
from .layout_checks import check_run, check_world

PARALLEL_MODES = ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel")
# MindFormers YAMLs write the mode as MindSpore's ParallelMode integer (3, hybrid_parallel, has no counterpart).
PARALLEL_MODE_IDS = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel"}
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# How attention sees a sequence split over context-parallel ranks (see mindformers_py.parallel.context.apply); MindFormers'
# names of the same algorithms are accepted as aliases.
CONTEXT_PARALLEL_ALGOS = ("ring", "ulysses", "hybrid")
CONTEXT_PARALLEL_ALIASES = {"colossalai_cp": "ring", "ring_attention": "ring", "ulysses_cp": "ulysses",
                            "hybrid_cp": "hybrid"}
ZERO_STAGES = (0, 1, 2, 3)
_SIZE_FIELDS = ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "virtual_pipeline_stages",
                "expert_parallel", "context_parallel")


# ---------------------------------------------------------------------------------------------------------------
# Parallel layout
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ParallelConfig(_Section):
    """How training is spread over processes (MindFormers' ``parallel_config`` plus ``parallel_mode``).

    Modes: ``stand_alone`` runs one process and ignores the layout sizes (so a YAML can keep its layout and
    still run on one device); ``data_parallel`` replicates the model on ``data_parallel`` processes (sharding
    optimizer state, gradients and parameters per ``optimizer_shard``) and allows no other size above 1;
    ``semi_auto_parallel`` applies the layout as given; ``auto_parallel`` lets the planner choose it: the sizes
    are hints, not checked against the world size, and the planner's answer comes from :meth:`with_layout`.

    The raw fields keep what the user wrote; :meth:`resolve` checks them against a run once and returns the
    frozen :class:`~.layout.Layout` the run reads (the degrees ``dp``, ``cp``, ``tp``, ``pp``, ``ep``, the ZeRO
    stage, the mesh). The read-only properties of those names give the same values for this config without the
    run's checks (the planner's candidates).
    """

    _SUBSECTIONS: ClassVar[tuple[str, ...]] = ("recompute",)

    parallel_mode: str | int = "stand_alone"
    """``"stand_alone"``, ``"data_parallel"``, ``"semi_auto_parallel"`` or ``"auto_parallel"`` (MindSpore's ids
    0/1/2 are accepted for the last three)."""
    data_parallel: int = 1
    """Data-parallel size: replicas that each see a different part of the global batch."""
    model_parallel: int = 1
    """Tensor-parallel size: ranks that split each layer's heads, FFN and (with ``vocab_emb_dp=False``) vocabulary."""
    pipeline_stage: int = 1
    """Pipeline-parallel size: ranks that each hold a consecutive slice of the layers."""
    micro_batch_num: int = 1
    """Micro-batches each data-parallel rank's batch is split into for the pipeline (>= ``pipeline_stage``);
    ignored when ``pipeline_stage`` is 1."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule from torch.distributed.pipelining: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``."""
    virtual_pipeline_stages: int = 1
    """Model chunks per pipeline rank; >= 2 with ``interleaved_1f1b`` (smaller bubble), otherwise 1."""
    expert_parallel: int = 1
    """Expert-parallel size: ranks that split each MoE layer's experts among them, borrowed from data (and context)
    parallelism (MindFormers' and torchtitan's meaning): it divides ``data_parallel * context_parallel``; tokens
    travel to their experts' ranks by all-to-all, and each expert's gradients are reduced over the
    ``data_parallel * context_parallel / expert_parallel`` ranks that hold it."""
    context_parallel: int = 1
    """Context-parallel size: ranks that split every sequence among them (MindFormers' name). Each holds its chunks
    of every sequence through the whole model; attention exchanges keys and values (``context_parallel_algo``), and
    gradients are reduced over data x context parallel ranks."""
    context_parallel_algo: str = "ring"
    """How attention sees the whole sequence: ``"ring"`` (key/value blocks passed around the ranks with an
    online-softmax merge; causal models get a load-balanced order of chunks), ``"ulysses"`` (all-to-all from
    sequence shards to head shards around attention, and back) or ``"hybrid"`` (Ulysses within groups of
    ``ulysses_degree_in_cp`` ranks, ring across the groups). MindFormers' ``colossalai_cp``/``ulysses_cp``/
    ``hybrid_cp`` are accepted."""
    ulysses_degree_in_cp: int | None = None
    """Ranks of each Ulysses group under ``context_parallel_algo="hybrid"`` (a divisor of ``context_parallel``
    between 1 and it); None picks the largest such divisor. Ignored by the other algorithms."""
    optimizer_shard: bool | int | str = 0
    """ZeRO stage over the data-parallel ranks: 0/False none, 1 optimizer state, 2 + gradients, 3 + parameters
    (FSDP2); True means 1, as in MindFormers."""
    optimizer_weight_shard_size: int = -1
    """Data-parallel ranks each FSDP shard group spans (ZeRO 2/3); -1 means all of them. A divisor of
    ``data_parallel`` below it gives HSDP: shards within groups of this size, replicas across the groups."""
    use_seq_parallel: bool = False
    """Sequence parallelism: norms and dropout run on sequence shards across the model-parallel ranks."""
    vocab_emb_dp: bool = True
    """Keep the embedding and LM head whole on every model-parallel rank; False shards the vocabulary (embedding
    and a vocabulary-parallel loss)."""
    shard_frozen_head: bool = False
    """Split a frozen output head (an adapter's run: LoRA) by vocabulary rows over the data-parallel (x context
    parallel) ranks, which otherwise each hold it whole; each reads only its rows. With ``fused_loss`` every rank's
    tokens are scored against each rank's rows (hidden states all-gathered over those ranks, their gradient
    reduce-scattered back): Qwen3's head is 0.58 GiB of bf16 a rank whole. For ``optimizer_shard=0`` without
    tensor or pipeline parallelism (ZeRO-2/3 shard the head already); a model whose head trains, is tied to the
    embedding or has a bias is refused. Ignored with one data-parallel rank."""
    recompute: RecomputeConfig | Mapping[str, Any] | bool | str | int | list[int] = field(
        default_factory=RecomputeConfig
    )
    """Activation recomputation: a :class:`RecomputeConfig`, a mapping of its fields or a shorthand of its
    ``recompute`` field (``"full"``, ``"selective"``, True/False, a layer count)."""

    def _convert(self) -> None:
        mode = self.parallel_mode
        if isinstance(mode, str) and mode.strip().isdigit():
            mode = int(mode.strip())
        if isinstance(mode, int) and not isinstance(mode, bool):
            if mode not in PARALLEL_MODE_IDS:
                raise invalid_choice("parallel_mode", self.parallel_mode, PARALLEL_MODES)
            mode = PARALLEL_MODE_IDS[mode]
        self.parallel_mode = _to_choice("parallel_mode", mode, PARALLEL_MODES)
        for name in _SIZE_FIELDS:
            setattr(self, name, _to_int(name, getattr(self, name)))
        self.pipeline_schedule = _to_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES,
                                            {"interleaved1f1b": "interleaved_1f1b"})
        self.context_parallel_algo = _to_choice("context_parallel_algo", self.context_parallel_algo,
                                                CONTEXT_PARALLEL_ALGOS, CONTEXT_PARALLEL_ALIASES)
        if self.ulysses_degree_in_cp is not None and not (isinstance(self.ulysses_degree_in_cp, str)
                                                          and self.ulysses_degree_in_cp.strip().lower() in ("none", "")):
            self.ulysses_degree_in_cp = _to_int("ulysses_degree_in_cp", self.ulysses_degree_in_cp)
        else:
            self.ulysses_degree_in_cp = None
        shard = self.optimizer_shard
        if isinstance(shard, str) and shard.strip().lower() in _TRUE_STRINGS + _FALSE_STRINGS:
            shard = shard.strip().lower() in _TRUE_STRINGS  # "1" lands on True = stage 1 either way
        elif isinstance(shard, str) and shard.strip().isdigit():
            shard = int(shard.strip())
        if isinstance(shard, bool):
            shard = int(shard)
        if type(shard) is not int or shard not in ZERO_STAGES:
            raise ConfigError(
                f"optimizer_shard={self.optimizer_shard!r} is not valid; choose one of: False, True (=1), 0, 1, 2, 3"
            )
        self.optimizer_shard = shard
        self.optimizer_weight_shard_size = _to_int("optimizer_weight_shard_size", self.optimizer_weight_shard_size, minimum=-1)
        self.use_seq_parallel = _to_bool("use_seq_parallel", self.use_seq_parallel)
        self.vocab_emb_dp = _to_bool("vocab_emb_dp", self.vocab_emb_dp)
        self.shard_frozen_head = _to_bool("shard_frozen_head", self.shard_frozen_head)
        if isinstance(self.recompute, (RecomputeConfig, Mapping)) or self.recompute is None:
            self.recompute = RecomputeConfig.coerce(self.recompute, "recompute")
        else:  # a shorthand of RecomputeConfig.recompute, whose messages already name "recompute"
            self.recompute = RecomputeConfig(recompute=self.recompute)

    # -- phase (a): the config on its own -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check the config on its own (types, ranges, mode, schedule, micro-batches, virtual stages, expert
        parallel); raise a one-line ConfigError naming the field, its value and what is valid."""
        if self.parallel_mode not in PARALLEL_MODES:
            raise invalid_choice("parallel_mode", self.parallel_mode, PARALLEL_MODES)
        for name in _SIZE_FIELDS:
            _require_int(name, getattr(self, name))
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise invalid_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if self.context_parallel_algo not in CONTEXT_PARALLEL_ALGOS:
            raise invalid_choice("context_parallel_algo", self.context_parallel_algo, CONTEXT_PARALLEL_ALGOS)
        validate_context_layout(self)
        if type(self.optimizer_shard) is not int or self.optimizer_shard not in ZERO_STAGES:
            raise invalid_choice("optimizer_shard", self.optimizer_shard, ZERO_STAGES)
        shard = self.optimizer_weight_shard_size
        if shard == 0 or (shard > 0 and self.is_distributed and self.data_parallel % shard):
            raise ConfigError(f"optimizer_weight_shard_size={shard} is not valid; use -1 (all data-parallel ranks) or a "
                              f"divisor of data_parallel={self.data_parallel}: {', '.join(map(str, _divisors(self.data_parallel)))}")
        for name in ("use_seq_parallel", "vocab_emb_dp", "shard_frozen_head"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; expected true or false")
        if not isinstance(self.recompute, RecomputeConfig):
            raise ConfigError(f"recompute={self.recompute!r} is not valid; expected a RecomputeConfig")
        with _prefixed("recompute"):
            self.recompute.validate()
        self._validate_pipeline()
        self._validate_mode_sizes()
        self._validate_frozen_head()

    def _validate_frozen_head(self) -> None:
        layout = Layout.reading(self)
        if not layout.frozen_head_sharded:  # (off, or one data-parallel rank: nothing to split over)
            return
        why = {"optimizer_shard": "ZeRO-2/3 shard the head already", "model_parallel": "vocab_emb_dp=False splits "
               "the head over the model-parallel ranks", "pipeline_stage": "the head lives on the last stage"}
        for name, value, valid in (("optimizer_shard", layout.zero_stage, 0), ("model_parallel", layout.tp, 1),
                                   ("pipeline_stage", layout.pp, 1)):
            if value != valid:
                raise ConfigError(f"shard_frozen_head=True is not valid with {name}={value} ({why[name]}); expected "
                                  f"{name}={valid}, or shard_frozen_head=False")

    def _validate_pipeline(self) -> None:
        pp, mb, vpp, schedule = self.pipeline_stage, self.micro_batch_num, self.virtual_pipeline_stages, \
            self.pipeline_schedule
        layers = self.recompute.recompute_num_layers
        if isinstance(layers, tuple) and len(layers) != pp:
            raise ConfigError(
                f"recompute.recompute_num_layers={list(layers)} is not valid; give one count per pipeline stage "
                f"({pp} for pipeline_stage={pp})"
            )
        if schedule == "interleaved_1f1b":
            if vpp < 2:
                raise ConfigError(
                    f"virtual_pipeline_stages={vpp} is not valid with pipeline_schedule='interleaved_1f1b'; "
                    "expected 2 or more model chunks per rank"
                )
            if pp < 2:
                raise ConfigError(
                    f"pipeline_schedule='interleaved_1f1b' is not valid with pipeline_stage={pp}; "
                    "expected pipeline_stage >= 2, or choose one of: 'gpipe', '1f1b'"
                )
        elif vpp != 1:
            raise ConfigError(
                f"virtual_pipeline_stages={vpp} is not valid with pipeline_schedule={schedule!r}; "
                "expected 1, or pipeline_schedule='interleaved_1f1b'"
            )
        if pp > 1 and mb < pp:
            raise ConfigError(
                f"micro_batch_num={mb} is not valid with pipeline_stage={pp}; expected micro_batch_num >= {pp}"
            )
        if schedule == "interleaved_1f1b":
            # torch's Interleaved1F1B runs micro-batches in rounds of mb // pp and needs whole rounds.
            rounds = max(1, mb // pp)
            if mb % rounds:
                raise ConfigError(
                    f"micro_batch_num={mb} is not valid with interleaved_1f1b and pipeline_stage={pp}; expected a "
                    f"multiple of micro_batch_num // pipeline_stage = {rounds}, e.g. {pp * rounds} or "
                    f"{pp * (rounds + 1)}"
                )

    def _validate_mode_sizes(self) -> None:
        if self.parallel_mode == "data_parallel":
            for name in ("model_parallel", "pipeline_stage", "expert_parallel", "context_parallel"):
                if getattr(self, name) != 1:
                    raise ConfigError(
                        f"{name}={getattr(self, name)} is not valid with parallel_mode='data_parallel' (expected 1); "
                        "use parallel_mode='semi_auto_parallel' for model, pipeline, expert or context parallelism"
                    )
        borrowed = self.data_parallel * self.context_parallel
        if borrowed % self.expert_parallel:
            what = f"data_parallel*context_parallel={self.data_parallel}*{self.context_parallel}={borrowed}" \
                if self.context_parallel > 1 else f"data_parallel={self.data_parallel}"
            raise ConfigError(
                f"expert_parallel={self.expert_parallel} is not valid; expert ranks are borrowed from data "
                f"{'and context ' if self.context_parallel > 1 else ''}parallelism, so it must divide {what}; "
                "choose one of: "
                f"{', '.join(map(str, _divisors(borrowed)))}"
            )

    # -- phase (b): the config against a run, once: the resolved Layout ----------------------------------------

    def resolve(
        self,
        world_size: int,
        model_config: Any = None,
        per_device_batch: int | None = None,
        global_batch: int | None = None,
        *,
        task: str | None = None,
        sequence_length: int | None = None,
    ) -> Layout:
        """Check the config against a run and return its frozen :class:`~.layout.Layout` (the degrees applied, the
        data-parallel engine, the mesh shape): ``world_size`` processes, a model config and batch sizes (and, for
        context parallelism, the task and the tokens per sequence when known). A run resolves its config once;
        everything downstream takes the ``Layout`` and checks nothing again.

        ``model_config`` is any object with ``num_attention_heads``, ``num_key_value_heads`` (None = heads),
        ``intermediate_size``, ``vocab_size``, ``num_hidden_layers``, ``fixed_sequence_length`` (models whose every
        input has that many tokens, such as ViT) and, for MoE, ``num_experts`` / ``expert_num`` /
        ``num_local_experts`` or a ``moe_config``; missing attributes are not checked.
        ``per_device_batch`` is the batch of one data-parallel rank, ``global_batch`` the batch of one step over
        all data-parallel ranks (before gradient accumulation). ``task`` (a task registry name) and
        ``sequence_length`` let context parallelism refuse a head or a length it cannot split
        (:func:`~.context.checks.validate_context_model`). In ``auto_parallel`` mode only ``world_size`` is
        checked (the layout's sizes are the planner's hints): resolve the planner's :meth:`with_layout` result.
        """
        self.validate()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r} is not valid; expected an integer >= 1")
        layout = Layout.of(self, world_size)
        if self.parallel_mode == "auto_parallel":
            return layout
        check_world(self, layout)
        check_run(layout, model_config, per_device_batch, global_batch, task=task, sequence_length=sequence_length)
        return layout

    def validate_for(
        self,
        world_size: int,
        model_config: Any = None,
        per_device_batch: int | None = None,
        global_batch: int | None = None,
        *,
        task: str | None = None,
        sequence_length: int | None = None,
    ) -> None:
        """Check the config against a run, as :meth:`resolve` does, keeping nothing (the planner's candidates, a
        user's own check): a run resolves instead and keeps the :class:`~.layout.Layout`."""
        self.resolve(world_size, model_config, per_device_batch, global_batch, task=task,
                     sequence_length=sequence_length)

    # -- layout helpers for the launcher, the planner and the engine --------------------------------------------

    def required_world_size(self) -> int:
        """Processes this config asks for: 1 (stand_alone), ``data_parallel`` (data_parallel), or
        data_parallel*context_parallel*model_parallel*pipeline_stage (semi_auto_parallel; auto_parallel's hint
        sizes)."""
        return Layout.of(self).required_world_size()

    def with_layout(self, data_parallel: int, model_parallel: int = 1, pipeline_stage: int = 1,
                    **fields: Any) -> ParallelConfig:
        """A validated copy with the given sizes (and any other ``fields``, e.g. ``expert_parallel``,
        ``micro_batch_num``); an ``auto_parallel`` config becomes ``semi_auto_parallel``, as the planner's
        answer is a fixed layout. Other modes are kept."""
        for key in fields:
            if key not in self.field_names():
                raise self._unknown_key(key)
        mode = "semi_auto_parallel" if self.parallel_mode == "auto_parallel" else self.parallel_mode
        return dataclasses.replace(self, **{"parallel_mode": mode, **fields, "data_parallel": data_parallel,
                                            "model_parallel": model_parallel, "pipeline_stage": pipeline_stage})

    def describe(self) -> str:
        """The layout this config applies, in one line (:meth:`Layout.describe <.layout.Layout.describe>`)."""
        return Layout.of(self).describe()

    def ignored_sizes(self, layout: Layout | None = None) -> dict[str, int]:
        """Layout sizes above 1 that this ``parallel_mode`` does not apply (``stand_alone`` runs one process whatever
        ``data_parallel`` says), by field name; a run warns about them rather than pretend they ran. ``layout``: this
        config's resolved layout, when there is one (else the degrees are derived here)."""
        layout = layout or Layout.reading(self)
        applied = {"data_parallel": layout.dp, "model_parallel": layout.tp, "pipeline_stage": layout.pp,
                   "expert_parallel": layout.ep, "context_parallel": layout.cp}
        return {name: getattr(self, name) for name, size in applied.items() if getattr(self, name) != size}

    def ignored_sizes_warning(self, layout: Layout | None = None) -> str | None:
        """One line saying which sizes this mode leaves unapplied and how to apply them; None when all apply."""
        ignored = self.ignored_sizes(layout)
        if not ignored:
            return None
        sizes = ", ".join(f"{name}={size}" for name, size in ignored.items())
        sized = ("data_parallel", "context_parallel", "model_parallel", "pipeline_stage")
        world = math.prod(ignored.get(name, 1) for name in sized)
        mode = "data_parallel" if set(ignored) == {"data_parallel"} else "semi_auto_parallel"
        return (f"parallel_mode={self.parallel_mode!r} runs one process, so {sizes} "
                f"{'is' if len(ignored) == 1 else 'are'} not applied; set parallel_mode={mode!r} to run {world} processes")

    def without_ignored_sizes(self) -> ParallelConfig:
        """A copy whose sizes are those applied (:meth:`ignored_sizes` set back to 1): what a run records."""
        return dataclasses.replace(self, **dict.fromkeys(self.ignored_sizes(), 1)) if self.ignored_sizes() else self

    @property
    def is_distributed(self) -> bool:
        """Whether the run uses torch.distributed (every mode except ``stand_alone``)."""
        return self.parallel_mode != "stand_alone"

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop(_DEGREES, None)  # a field changed: the degrees read from the old values are dropped
        super().__setattr__(name, value)


_DEGREES = "_degrees_read"
"""Where a config keeps the :class:`~.layout.Layout` its derived degrees were read from, until a field is set."""


def _derived(name: str) -> property:
    """``ParallelConfig.<name>``: :class:`~.layout.Layout`'s ``<name>`` for this config, derived without the run's
    checks (:meth:`Layout.reading <.layout.Layout.reading>`): what the planner and a user read; a run reads its
    resolved ``Layout``. Derived once per config and kept until a field is set (the planner reads some 40 of them for
    each of the thousands of layouts it estimates); none of them depends on ``recompute``, whose own fields may
    change without a set here."""

    def read(self: ParallelConfig) -> Any:
        layout = self.__dict__.get(_DEGREES)
        if layout is None:
            layout = self.__dict__[_DEGREES] = Layout.reading(self)
        return getattr(layout, name)

    return property(read, doc=f"``{name}`` as this config applies it in its mode (see :attr:`Layout.{name} "
                              f"<.layout.Layout>`).")


for _name in ("dp", "cp", "tp", "pp", "ep", "vpp", "micro_batches", "cp_ulysses", "cp_ring", "zero_stage", "shard_size",
              "data_parallel_engine", "sequence_parallel", "vocab_parallel", "frozen_head_sharded",
              "torch_schedule_name"):
    setattr(ParallelConfig, _name, _derived(_name))
del _name
