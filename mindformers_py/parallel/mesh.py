"""The device mesh of a run: torch's ``DeviceMesh`` with named dimensions built from a resolved :class:`~.layout.Layout`.

One 5-D world mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` (torchtitan's layout, sizes of 1 kept so
every dimension can always be named) covers every layout. Data parallelism is split in two so that ZeRO and HSDP
are the same mesh read differently: ``dp_shard`` ranks shard parameters, gradients and optimizer state (FSDP2), and
``dp_replicate`` ranks hold replicas that all-reduce their gradients; the flattened ``"dp"`` dimension is the
whole data-parallel group (it splits the batch and gathers evaluation outputs).

Context parallelism (``"cp"``) splits every sequence; its ranks hold the same samples but different tokens, so for
gradients they are data parallel too (torchtitan folds them into FSDP's mesh): gradients are reduced, and ZeRO
shards, over ``dp_shard x cp`` (:attr:`ParallelMesh.fsdp_mesh`), and losses, item counts and metric sums over
``dp x cp`` (:attr:`ParallelMesh.batch_mesh`). Under the hybrid algorithm a second mesh over the same ranks,
``("pp", "dp", "cp_ring", "cp_ulysses", "tp")`` (:data:`CONTEXT_MESH_DIMS`), splits the context-parallel index into
the ring and the Ulysses group.

Expert parallelism borrows its ranks from data (and context) parallelism (MindFormers' and torchtitan's meaning):
with ``expert_parallel > 1`` a second mesh over the same ranks, ``("pp", "dp_mod_ep", "ep", "tp")``
(:data:`EXPERT_MESH_DIMS`), splits the index ``d`` over data x context parallel ranks into ``d // ep`` and
``d % ep``. Experts are sharded over ``"ep"`` (and over ``"tp"`` by tensor parallelism), tokens travel by
all-to-all within ``"ep"``, and an expert's gradients are reduced over ``"dp_mod_ep"``, the ranks holding the same
experts.

The backend is NCCL on CUDA and gloo on CPU; tests run every layout on CPU with gloo.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ConfigError
from .layout import MESH_DIMS, Layout

EXPERT_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "tp")
CONTEXT_MESH_DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
DEFAULT_TIMEOUT_S = 600


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the process group described by the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), unless this process already joined one.

    ``backend`` defaults to NCCL on CUDA and gloo on CPU. ``timeout_s`` bounds every collective, so a rank that
    died makes the others fail with an error instead of hanging forever (default: ``MINDFORMERS_DIST_TIMEOUT``
    seconds, else 600).
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"torch.distributed environment is incomplete (missing {', '.join(missing)}); start the run with "
            "torchrun or `mindformers-py run` (the Trainer and pipeline() start their own), or use "
            "parallel_mode='stand_alone'"
        )
    device_type = default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if timeout_s is None:
        timeout_s = float(os.environ.get("MINDFORMERS_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group(
        backend=backend or ("nccl" if device_type == "cuda" else "gloo"),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Leave the group while the interpreter is still whole. A process that exits with its group alive leaves gloo's
    # C++ worker threads to be torn down during interpreter finalization, which now and then aborts the process
    # ("terminate called without an active exception", SIGABRT) after a run that succeeded.
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ParallelMesh:
    """The world mesh and its named sub-meshes, for one process.

    Attributes:
        world: the 5-D ``DeviceMesh`` over ``MESH_DIMS``, or None for a single process without a process group.
        pp: pipeline-parallel size.
        dp_replicate: data-parallel replicas (DDP, or the replicate dimension of HSDP).
        dp_shard: data-parallel ranks that shard state (FSDP2); 1 without ZeRO stages 2/3.
        cp: context-parallel size.
        tp: tensor-parallel size.
        ep: expert-parallel size (a divisor of the data x context parallel size).
        expert_world: the 4-D mesh over :data:`EXPERT_MESH_DIMS` when ``ep > 1``, else None.
        cp_ulysses: ranks of each Ulysses group of the context parallelism (1 for the ring alone).
        context_world: the 5-D mesh over :data:`CONTEXT_MESH_DIMS` under the hybrid algorithm, else None.
    """

    world: DeviceMesh | None
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    expert_world: DeviceMesh | None = None
    cp_ulysses: int = 1
    context_world: DeviceMesh | None = None

    @property
    def dp(self) -> int:
        """Whole data-parallel size (replicas x shards): how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``."""
        return self.world.device_type if self.world is not None else default_device_type()

    def _sub(self, name: str) -> DeviceMesh | None:
        return self.world[name] if self.world is not None else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """1-D tensor-parallel mesh (None for a single process)."""
        return self._sub("tp")

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """1-D pipeline mesh (None for a single process)."""
        return self._sub("pp")

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """1-D mesh over every data-parallel rank (replicas and shards flattened): batch split, metric means,
        DDP and ZeRO-1's optimizer-state partition."""
        if self.world is None:
            return None
        return self.world["dp_replicate", "dp_shard"]._flatten("dp")

    @property
    def batch_mesh(self) -> DeviceMesh | None:
        """1-D mesh over every rank holding different data, data x context parallel (the data-parallel mesh without
        context parallelism): gradients are averaged over it, and losses, item counts and metric sums are summed
        over it. DDP, replicate and ZeRO-1 run on it."""
        if self.world is None:
            return None
        if self.cp == 1:
            return self.dp_mesh
        return self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh handed to FSDP2's ``fully_shard``: 1-D ``dp_shard`` (FSDP; ``dp_shard x cp`` flattened under
        context parallelism), or 2-D ``(dp_replicate, dp_shard[ x cp])`` when there are replicas too (HSDP:
        replicate across the first, shard across the second)."""
        if self.world is None:
            return None
        shard = self.world["dp_shard", "cp"]._flatten("dp_shard_cp") if self.cp > 1 else self.world["dp_shard"]
        if self.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard_cp" if self.cp > 1 else "dp_shard"]
        return shard

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks that split each sequence (None for a single process)."""
        return self._sub("cp")

    @property
    def cp_ring_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks passing key/value blocks around a ring (the whole ``cp`` mesh for the ring
        algorithm, across the Ulysses groups under hybrid); None without a ring."""
        if self.cp == 1 or self.cp_ulysses == self.cp:
            return None
        return self.context_world["cp_ring"] if self.context_world is not None else self.cp_mesh

    @property
    def cp_ulysses_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks exchanging heads by all-to-all (the whole ``cp`` mesh for Ulysses, one group
        under hybrid); None without Ulysses."""
        if self.cp_ulysses == 1:
            return None
        return self.context_world["cp_ulysses"] if self.context_world is not None else self.cp_mesh

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The mesh routed experts are split over: ``("ep", "tp")`` (or ``"ep"`` / ``"tp"`` alone when the other
        is 1); None when neither splits them."""
        if self.ep > 1:
            return self.expert_world["ep", "tp"] if self.tp > 1 else self.expert_world["ep"]
        return self.tp_mesh if self.tp > 1 else None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks that exchange tokens by all-to-all (None without expert parallelism)."""
        return self.expert_world["ep"] if self.ep > 1 else None

    @property
    def expert_dp_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the data (x context) parallel ranks that hold the same experts (``dp * cp / ep`` of them),
        over which the experts' gradients are reduced (None without expert parallelism)."""
        return self.expert_world["dp_mod_ep"] if self.ep > 1 else None

    def local_rank(self, dim: str) -> int:
        """This process's coordinate along ``dim`` (``"pp"``, ``"dp"``, ``"tp"``, ...); 0 for a single process."""
        if self.world is None:
            return 0
        if dim == "dp":
            return self.dp_mesh.get_local_rank()
        return self.world.get_local_rank(dim)

    @property
    def dp_rank(self) -> int:
        """Index of this process's data-parallel replica/shard, which picks its part of the global batch."""
        return self.local_rank("dp")

    @property
    def tp_rank(self) -> int:
        """Index of this process within its tensor-parallel group."""
        return self.local_rank("tp")

    @property
    def pp_rank(self) -> int:
        """Pipeline stage index of this process."""
        return self.local_rank("pp")

    @property
    def cp_rank(self) -> int:
        """Index of this process within its context-parallel group: which chunks of each sequence it holds."""
        return self.local_rank("cp")


def mesh_sizes(layout: Layout, shard_size: int | None = None) -> dict[str, int]:
    """Sizes of ``MESH_DIMS`` for ``layout`` (:meth:`Layout.mesh_sizes <.layout.Layout.mesh_sizes>`).

    When FSDP2 shards the state (ZeRO stages 2 and 3, see :mod:`.data`), it shards over ``shard_size``
    data-parallel ranks (default: the layout's, else all of them, plain FSDP); a smaller ``shard_size`` keeps
    ``dp / shard_size`` replicas of each shard (HSDP, MindFormers' ``optimizer_weight_shard_size``). Otherwise all
    data-parallel ranks are replicas.
    """
    return layout.mesh_sizes(shard_size)


def build_mesh(layout: Layout, shard_size: int | None = None, device_type: str | None = None) -> ParallelMesh:
    """The :class:`ParallelMesh` of a resolved ``layout`` (:meth:`ParallelConfig.resolve
    <.config.ParallelConfig.resolve>`) for this process, joining the process group if needed.

    ``stand_alone`` (or any layout of one process without a process group) gives a mesh-less
    :class:`ParallelMesh`. The layout was checked when it was resolved; only its world size is compared with the
    process group's here.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"build_mesh takes a resolved Layout (ParallelConfig.resolve), not a {type(layout).__name__}")
    sizes = mesh_sizes(layout, shard_size)
    if not layout.is_distributed and not dist.is_initialized():
        return ParallelMesh(world=None, **{k: 1 for k in sizes})
    init_distributed()
    if dist.get_world_size() != layout.world_size:
        raise ConfigError(f"the layout was resolved for world_size={layout.world_size}, but this process group has "
                          f"{dist.get_world_size()} processes; resolve it for this run (ParallelConfig.resolve)")
    device_type = device_type or default_device_type()
    shape = tuple(sizes[d] for d in MESH_DIMS)
    world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    experts = context = None
    if layout.ep > 1:
        # The same ranks, data (x context) parallelism split the other way: rank order (pp, dp, cp, tp) with the
        # index over data x context parallel ranks d * cp + c = dp_mod_ep * ep + ep index, so both meshes agree.
        experts = init_device_mesh(device_type, (layout.pp, layout.dp * layout.cp // layout.ep, layout.ep, layout.tp),
                                   mesh_dim_names=EXPERT_MESH_DIMS)
    if 1 < layout.cp_ulysses < layout.cp:  # hybrid: the context-parallel index c = ring index * ulysses + its member
        context = init_device_mesh(device_type, (layout.pp, layout.dp, layout.cp_ring, layout.cp_ulysses, layout.tp),
                                   mesh_dim_names=CONTEXT_MESH_DIMS)
    mesh = ParallelMesh(world=world, ep=layout.ep, expert_world=experts, cp_ulysses=layout.cp_ulysses,
                        context_world=context, **sizes)
    # Every group the run uses is created now (the flattened dimensions too), and every rank finishes before any
    # goes on: a rank that then stops at once (a refused layout) must not take the rendezvous store down while
    # another still creates its single-rank groups of the size-1 dimensions.
    mesh.dp_mesh, mesh.batch_mesh, mesh.fsdp_mesh  # noqa: B018 (each property flattens on first use)
    dist.barrier()
    return mesh
