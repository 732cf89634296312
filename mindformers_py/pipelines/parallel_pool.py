"""Parallel generation for the pipelines: a pool of worker processes holding the model sharded by a layout.

``pipeline(task, model=..., parallel_config=ParallelConfig(model_parallel=2))`` (or ``pipeline_stage``, their product,
or ``expert_parallel`` for an MoE model) starts ``data_parallel x model_parallel x pipeline_stage`` workers on this
machine with torch's elastic agent (the launcher of ``mindformers-py run``), each loading the model and keeping its
shard of the weights (and, while generating, of the KV cache): see :mod:`mindformers_py.parallel.inference`. The
pipeline object in this process keeps transformers' pre- and post-processing and a stand-in for the model (its config,
generation config and class, with weights on the ``meta`` device); the stand-in's ``generate`` sends each request to
every worker and returns rank 0's answer, forwarding the tokens to a ``streamer`` as they come.

The pool stays up across calls and stops with the pipeline: ``pipe.close()``, ``with pipeline(...) as pipe:``, when
the pipeline is garbage-collected, or when the interpreter exits. A worker that fails (or is killed) ends the pool;
the call raises one line naming the rank and the error, and the next call starts a new pool. An interrupt
(``KeyboardInterrupt``) during a call stops the workers too.

Sampling (``do_sample=True``) draws from this process's random state, which the workers receive and hand back, so a
seeded run samples the same tokens as in one process (as long as the sharded logits round the same way).
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import signal
import tempfile
import threading
import traceback
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from torch import nn

from ..adapters.apply import from_pretrained_with_adapter, is_peft_model
from ..adapters.files import adapter_base, is_adapter_folder
from ..errors import MindFormersError
from ..loading.deferred import deferred_loading, materialize
from ..parallel.tensor.adapters import adapted_model
from ..loading.handover import dumps, weights_by_reference
from ..parallel.layout import Layout
from ..launcher.launch import LaunchError, adopt_environment, launch, main_module_not_rerun, prepare_fork_server, \
    quiet_agent, threads_per_worker

_START_TIMEOUT_S = 600
_STOP_TIMEOUT_S = 30


class InferencePool:
    """Workers holding a model sharded by ``layout`` that run ``generate`` on request (see the module docstring).

    Args:
        source: a checkpoint folder or a saved peft adapter's folder (each worker loads it: an adapter's base model,
            then the adapter), or a model object, a peft model too (sent to the workers pickled, its weights by
            reference: :mod:`~mindformers_py.loading.handover`). Each worker reads only its shards.
        task: the task registry name whose Auto class loads a folder (``"causal_lm"``, ``"seq2seq_lm"``).
        layout: the layout, as :func:`~mindformers_py.parallel.inference.inference_layout` returns it.
        load_kwargs: ``from_pretrained`` arguments for a folder (``dtype``).
    """

    def __init__(self, source: str | os.PathLike | nn.Module, task: str, layout: Layout,
                 load_kwargs: dict[str, Any] | None = None) -> None:
        self.layout = layout
        self.world_size = layout.required_world_size()
        self._folder = Path(tempfile.mkdtemp(prefix="mindformers-pool-"))
        if isinstance(source, nn.Module):  # its weights by reference: each worker reads only its shards
            model_file = self._folder / "model.pkl"
            with weights_by_reference(source, self._folder / "weights") as by_reference:
                model_file.write_bytes(dumps(source, by_reference))
            self._source: dict[str, Any] = {"pickled": str(model_file)}
        else:
            self._source = {"folder": os.fspath(source), "task": task, "load_kwargs": dict(load_kwargs or {})}
        self._lock = threading.RLock()
        self._state: _PoolState | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._folder, [None])

    # -- lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (if not running) and wait until every one holds its shard."""
        with self._lock:
            if self._closed:
                raise MindFormersError("this pipeline was closed; create a new one to generate again")
            if self._state is not None and self._state.alive():
                return
            self._state = _PoolState.start(self._source, self.layout, self.world_size)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _cleanup, self._folder, [self._state])

    def close(self) -> None:
        """Stop the workers (waiting for them to exit); the pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._finalizer()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by rank (empty when not running)."""
        return list(self._state.pids) if self._state is not None and self._state.alive() else []

    # -- requests -----------------------------------------------------------------------------------------------------

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(*args, **kwargs)`` on every worker; rank 0's result. A ``streamer`` gets the tokens here
        as rank 0 produces them."""
        streamer = kwargs.pop("streamer", None)
        rng = torch.get_rng_state()
        reply = self._request("generate", (args, kwargs, streamer is not None, rng), streamer)
        result, rng = reply
        torch.set_rng_state(rng)  # as if this process had drawn the samples
        return result

    def memory(self) -> list[dict[str, int]]:
        """Per rank: ``weights_bytes`` held and ``kv_cache_bytes_per_token`` (measured on a short forward)."""
        return self._request("memory", None, None)

    def _request(self, kind: str, payload: Any, streamer: Any) -> Any:
        with self._lock:
            self.start()
            state = self._state
            try:
                return state.request(kind, payload, streamer)
            except BaseException:
                state.stop(force=True)  # a failed or interrupted call leaves no half-finished workers
                raise


class _PoolState:
    """One running set of workers: the agent thread, the queues and the workers' process ids."""

    def __init__(self, world_size: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        self.requests = [context.Queue() for _ in range(world_size)]
        self.replies = context.Queue()
        self.pids: list[int] = [0] * world_size
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    @classmethod
    def start(cls, source: dict[str, Any], layout: Layout, world_size: int) -> _PoolState:
        state = cls(world_size)
        prepare_fork_server()
        args = (source, layout.to_dict(), state.requests, state.replies, threads_per_worker(world_size),
                dict(os.environ))

        def agent() -> None:
            try:
                with quiet_agent():
                    launch(_serve, world_size, *args, start_method="forkserver")
            except BaseException as err:  # noqa: BLE001 - reported to the caller by request()
                state.error = err

        state.thread = threading.Thread(target=agent, name="mindformers-inference-pool", daemon=True)
        with main_module_not_rerun():  # until every worker runs (see launch_from_python)
            state.thread.start()
            ready = 0
            while ready < world_size:
                message = state._reply(_START_TIMEOUT_S)
                if message[0] != "ready":
                    raise MindFormersError(f"unexpected message {message[0]!r} from a starting worker")
                state.pids[message[1]] = message[2]
                ready += 1
        return state

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.error is None

    def request(self, kind: str, payload: Any, streamer: Any) -> Any:
        data = cloudpickle.dumps(payload)
        for requests in self.requests:
            requests.put((kind, data))
        while True:
            message = self._reply(None)
            if message[0] == "token":
                streamer.put(message[1])
            elif message[0] == "end":
                streamer.end()
            elif message[0] == "done":
                return cloudpickle.loads(message[1])
            else:
                raise MindFormersError(f"unexpected message {message[0]!r} from the workers")

    def _reply(self, timeout: float | None) -> tuple:
        """The next message from the workers; a worker's failure (or the agent's) raises one line."""
        waited = 0.0
        while True:
            try:
                message = self.replies.get(timeout=0.1)
            except queue.Empty:
                waited += 0.1
                if not self.thread.is_alive():
                    raise self._failure() from None
                if timeout is not None and waited > timeout:
                    raise MindFormersError(f"the inference workers did not answer within {timeout:.0f} s") from None
                continue
            if message[0] == "error":
                self.thread.join(timeout=_STOP_TIMEOUT_S)  # the agent stops the other workers
                raise LaunchError(f"rank {message[1]} of the {len(self.pids)} inference workers failed with "
                                  f"{message[2]}; the pool was stopped (the next call starts a new one)")
            return message

    def _failure(self) -> Exception:
        error = self.error
        if isinstance(error, LaunchError):
            return LaunchError(f"{error}; the inference pool was stopped (the next call starts a new one)")
        return LaunchError(f"the inference pool stopped ({type(error).__name__}: {error})" if error
                           else "the inference pool stopped")

    def stop(self, force: bool = False) -> None:
        """Ask the workers to exit (or kill them with ``force``) and wait for the agent."""
        if self.thread is None or not self.thread.is_alive():
            return
        if not force:
            for requests in self.requests:
                requests.put(("stop", None))
            self.thread.join(timeout=_STOP_TIMEOUT_S)
        if self.thread.is_alive():
            for pid in self.pids:
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.thread.join(timeout=_STOP_TIMEOUT_S)


def _cleanup(folder: Path, states: list[_PoolState | None]) -> None:
    for state in states:
        if state is not None:
            state.stop()
    shutil.rmtree(folder, ignore_errors=True)


# -- the parent's stand-in for the model ---------------------------------------------------------------------------


class PooledModelMixin:
    """What the pipeline holds in this process instead of the model (see the module docstring): the model's class,
    config and generation config with weights on the ``meta`` device; ``generate`` runs in :attr:`pool`."""

    pool: InferencePool

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``generate`` in the pool of workers (rank 0's result)."""
        return self.pool.generate(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where the pipeline keeps inputs and outputs: this process's CPU (each worker uses its own device)."""
        return torch.device("cpu")

    def to(self, *args: Any, **kwargs: Any) -> PooledModelMixin:
        """The weights live in the workers: nothing moves."""
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise MindFormersError("this model's weights live in its pipeline's worker pool: call the pipeline (or "
                               "model.generate), not the model")

    def close_pool(self) -> None:
        """Stop the pool of workers."""
        self.pool.close()


_POOLED_CLASSES: dict[type, type] = {}


def pooled_model(config: Any, model_class: type, generation_config: Any, pool: InferencePool) -> nn.Module:
    """The stand-in: a ``model_class`` built from ``config`` on the meta device (no memory), generating in ``pool``."""
    with torch.device("meta"):
        skeleton = model_class(config)
    if model_class not in _POOLED_CLASSES:
        _POOLED_CLASSES[model_class] = type(f"Pooled{model_class.__name__}", (PooledModelMixin, model_class),
                                            {"__module__": model_class.__module__})
    skeleton.__class__ = _POOLED_CLASSES[model_class]
    skeleton.eval()
    if generation_config is not None:
        skeleton.generation_config = generation_config
    skeleton.pool = pool
    return skeleton


# -- the worker side ------------------------------------------------------------------------------------------------


def _serve(source: dict[str, Any], layout: dict[str, Any], requests: list, replies: Any, threads: int,
           env: dict[str, str]) -> None:
    """One worker: join the pool's process group, load and shard the model, answer requests until told to stop."""
    import torch.distributed as dist

    from ..models.cache_names import output_cache
    from ..parallel.inference import cache_bytes, local_bytes, shard_for_inference
    from ..parallel.mesh import build_mesh, init_distributed

    adopt_environment(env)
    torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    try:
        use_cuda = torch.cuda.is_available()
        init_distributed(backend=None if use_cuda else "gloo")
        config = Layout.from_dict(layout)  # resolved by the process that started the pool: read, not checked again
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        mesh = build_mesh(config, device_type=device.type)
        with deferred_loading():  # built on meta: the layout is applied first, then only this rank's shards are read
            model = _load(source).eval()
        shard_for_inference(adapted_model(model), config, mesh)  # a peft model's adapters are sharded with their layers
        materialize(model, device).to(device)
        replies.put(("ready", rank, os.getpid()))
        while True:
            kind, data = requests[rank].get()
            if kind == "stop":
                break
            payload = cloudpickle.loads(data)
            if kind == "generate":
                args, kwargs, stream, rng = payload
                torch.set_rng_state(rng)
                streamer = _Stream(replies) if stream and rank == 0 else None
                with torch.inference_mode():
                    result = model.generate(*args, **_to_device(kwargs, device), streamer=streamer)
                answer: Any = (_to_device(result, torch.device("cpu")), torch.get_rng_state())
            else:  # memory
                probe = torch.zeros(1, 8, dtype=torch.long, device=device)
                extra = {"decoder_input_ids": probe} if getattr(model.config, "is_encoder_decoder", False) else {}
                with torch.inference_mode():
                    out = model(input_ids=probe, use_cache=True, **extra)
                mine = {"weights_bytes": local_bytes(model),
                        "kv_cache_bytes_per_token": cache_bytes(output_cache(out)) // probe.shape[1]}
                answer = [None] * dist.get_world_size()
                dist.all_gather_object(answer, mine)
            if rank == 0:
                replies.put(("done", cloudpickle.dumps(answer)))
    except BaseException as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        replies.put(("error", rank, f"{type(exc).__name__}: {first}", traceback.format_exc()))
        raise
    dist.destroy_process_group()


def _load(source: dict[str, Any]) -> nn.Module:
    if "pickled" in source:
        return cloudpickle.loads(Path(source["pickled"]).read_bytes())
    from ..auto import auto_class_for

    return from_pretrained_with_adapter(auto_class_for(source["task"]), source["folder"], **source["load_kwargs"])


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_device(v, device) for v in value)
    return value


class _Stream:
    """Rank 0's streamer: sends each token batch to the parent, whose own streamer receives it."""

    def __init__(self, replies: Any) -> None:
        self.replies = replies

    def put(self, value: torch.Tensor) -> None:
        self.replies.put(("token", value.cpu()))

    def end(self) -> None:
        self.replies.put(("end",))


# -- building a parallel pipeline's model ---------------------------------------------------------------------------


def start_pooled_model(pipeline_class: type, task_name: str, auto_model: type, task: str, model: Any,
                       parallel_config: Any, load_kwargs: dict[str, Any]) -> tuple[nn.Module, Path | None] | None:
    """For ``pipeline(..., parallel_config=...)``: start the pool and return ``(stand-in model, checkpoint folder)``, or
    None when the layout is one process (the pipeline then runs here). Refused in one line: a task that does not
    generate, and what :func:`~mindformers_py.parallel.inference.inference_layout` refuses."""
    from transformers import GenerationConfig, PreTrainedModel

    from ..auto import resolve_config
    from ..parallel.inference import inference_layout

    sizes = parallel_config if isinstance(parallel_config, Mapping) else vars(parallel_config)
    if math.prod(int(sizes.get(k, 1)) for k in ("data_parallel", "context_parallel", "model_parallel",
                                                "pipeline_stage")) == 1:
        return None
    if not getattr(pipeline_class, "_pipeline_calls_generate", False):
        raise MindFormersError(f"parallel_config applies to the generating pipelines (text-generation, "
                               f"text2text-generation, summarization, translation); {task_name!r} runs in one process")
    folder = Path(model) if isinstance(model, (str, os.PathLike)) and Path(model).is_dir() else None
    adapter = False
    if folder is not None:
        adapter = is_adapter_folder(folder)  # a saved peft adapter: its base model's config, the adapter on it
        base = Path(adapter_base(folder)) if adapter else folder
        config = resolve_config(str(base))[0]
        generation_config = GenerationConfig.from_pretrained(base) if (base / "generation_config.json").is_file() \
            else None
        source: Any = folder
    else:
        if isinstance(model, (str, os.PathLike)):  # a preset: random weights, made here so every worker has the same
            model = auto_model.from_pretrained(model, **load_kwargs)
        adapter = is_peft_model(model)
        base_model = adapted_model(model)
        if not isinstance(base_model, PreTrainedModel):
            raise MindFormersError(f"model={type(model).__name__} is not a model, a peft model, a checkpoint folder or "
                                   "a preset name")
        config, generation_config, source = base_model.config, base_model.generation_config, model
    layout = inference_layout(parallel_config, config)
    if adapter and layout.pp > 1:
        raise MindFormersError(f"parallel_config.pipeline_stage={layout.pp} does not apply to a peft adapter (pipeline "
                               "stages run the base model's layers, not peft's forward); split it with model_parallel, "
                               "or merge the adapter into its base first (merge_and_unload)")
    with torch.device("meta"):
        model_class = type(auto_model.from_config(config)) if folder is not None else type(adapted_model(model))
    pool = InferencePool(source, task, layout, load_kwargs)
    pool.start()
    return pooled_model(config, model_class, generation_config, pool), folder
