"""A ``torch.compile``-d decode step for the lean loop (gpt-fast's idea, on the model's own forward).

A decode step of a small model is mostly per-operator dispatch: a few dozen modules, each a handful of small
kernels on one row per sequence. Compiling the model's forward turns a step into one call of generated code
(inductor fuses the element-wise work and calls the matrix products directly), which on CPU halves a small GPT's
step. The step runs the model's own forward over the lean loop's :class:`~.static_cache.StaticKVCache`; the number
of cached tokens is a Python int that dynamo treats as a dynamic size, so one graph serves every step and every
prompt length (``dynamic=True``), and a batch of one gets its own specialised graph. The skinny-GEMM formulations
of :mod:`.skinny_linear` stay in force inside the graph: dynamo traces their forwards and takes each call's
transposed weight copies as graph inputs, so a later call reuses the graph.

Compiling costs seconds to minutes once per model (and far less in a later process, from inductor's on-disk
cache), so it runs only when asked, with transformers' switch: ``generate(..., cache_implementation="static")``
(where transformers compiles its forward on accelerators; here on CPU too, where it is measured faster),
``compile_config`` giving the ``torch.compile`` options and ``disable_compile=True`` turning it off.

On a CUDA device the step is instead compiled for fixed shapes and captured in a CUDA graph
(:mod:`.graphed_step`), unless ``model.cuda_graph_decode`` is False.

Every step evaluates dynamo's guards. Skipping them after the first step
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``) saved some host overhead but is unsafe: when the
forward's code already has other cache entries (another model of the class compiled earlier in the process) or a
step needs a new graph (mixture-of-experts rows per expert), a step raises instead of recompiling. It failed that
way in the test suite, so the guards are always checked.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.configuration_utils import CompileConfig, GenerationConfig


logger = logging.getLogger(__name__)

# model -> {compile options: compiled forward}; weak, so a dropped model takes its compiled code with it.
_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Callable]] = weakref.WeakKeyDictionary()


def wants_compiled_step(config: GenerationConfig) -> bool:
    """Whether ``generate`` should run the compiled decode step: a static cache asked for and compilation not
    disabled (transformers' switch)."""
    return config.cache_implementation == "static" and not config.disable_compile


def compiled_forward(model: torch.nn.Module, compile_config: CompileConfig | None,
                     static_shapes: bool = False) -> Callable[..., Any]:
    """``model``'s forward compiled with ``compile_config``'s options (dynamic shapes unless it says otherwise;
    ``mode`` only when a config is given, since transformers' default ``"reduce-overhead"`` records CUDA graphs,
    one per cache length here). ``static_shapes``: for the step :mod:`.graphed_step` captures in a CUDA graph
    (:func:`graph_compile_options`). Compiled once per model and options, then reused."""
    if compile_config is None:
        options: dict[str, Any] = {"fullgraph": False, "dynamic": True, "backend": "inductor", "mode": None}
    else:
        options = {"fullgraph": compile_config.fullgraph,
                   "dynamic": True if compile_config.dynamic is None else compile_config.dynamic,
                   "backend": compile_config.backend, "mode": compile_config.mode}
        if compile_config.options:
            options["options"] = dict(compile_config.options)
            options.pop("mode")  # torch.compile takes one of mode and options
    if static_shapes:
        options = graph_compile_options(options)
    key = tuple(sorted((k, repr(v)) for k, v in options.items()))
    per_model = _COMPILED.setdefault(model, {})
    if key not in per_model:
        logger.info("compiling the decode step of %s (once per model; later processes reuse inductor's cache)",
                    type(model).__name__)
        per_model[key] = torch.compile(model, **options)
    return per_model[key]


def graph_compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``torch.compile`` options of a step that :mod:`.graphed_step` captures in a CUDA graph: static shapes,
    and no CUDA graphs of inductor's own inside the captured one (``"reduce-overhead"`` becomes the default mode, ``"max-autotune"`` its
    variant without CUDA graphs)."""
    options = {**options, "dynamic": False}
    mode = options.get("mode")
    if mode in ("reduce-overhead", "default"):
        options["mode"] = None
    elif mode == "max-autotune":
        options["mode"] = "max-autotune-no-cudagraphs"
    inductor = dict(options.get("options") or {})
    if inductor:
        inductor["triton.cudagraphs"] = False
        options["options"] = inductor
    return options
