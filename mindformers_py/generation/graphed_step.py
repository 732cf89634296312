"""The compiled decode step captured in a CUDA graph: on a GPU, a step of a small model is mostly kernel launches.

A decode step of a ~1B model on a GPU reads its weights in about a millisecond, but launches some 700 kernels, each
with its Python and dispatcher work: eager decoding ran at ~17 ms a token on an H100 (58 tokens/s), and compiling
the step (fewer, fused kernels) still launches each of them from Python. A CUDA graph records the launches of one
step once and replays them with a single call (gpt-fast's and transformers' ``"reduce-overhead"`` idea), so a token
costs about what the GPU needs.

A graph replays fixed addresses and shapes, so the step here sees nothing that changes between tokens:

* the cache's buffers are handed to attention whole (:class:`~.static_cache.StaticKVCache` in *slot* mode: each
  layer writes the new key and value at the position held in a one-element device tensor, ``index_copy_``, and
  returns its entire buffers), with a boolean key mask (B, 1, 1, capacity) that is True for the real keys written
  so far: the prompt's unpadded positions, then one more per step;
* the token, its position, the slot and the mask live in tensors allocated once and updated in place before each
  replay (device-side copies and fills: no host-device synchronisation between tokens);
* the cache's capacity is rounded up to a multiple of :data:`CAPACITY_STEP` tokens, so one compiled graph serves
  every request whose prompt and new tokens fit the bucket (the compiled code is specialised to the shapes:
  ``dynamic=False``).

The forward is compiled (inductor, its default mode: the graph is captured here, so inductor's own CUDA graphs,
``"reduce-overhead"``, are not used inside it), warmed up on a side stream and captured with
``torch.cuda.CUDAGraph`` at the first one-token step of each generation; every later step is a replay. The prompt's
forward runs as before (eager, writing the cache by slices).

Only where it can work: a CUDA device, a compiled step asked for (``cache_implementation="static"`` without
``disable_compile``), a decoder-only model without a sliding window (whose 2-D window mask the model builds per
step), without routed experts and without dynamic or long rope (both read values from the device between tokens),
and ``model.cuda_graph_decode`` left True. Elsewhere (the CPU among them) the compiled step of
:mod:`.compiled_step` runs as before. If the capture fails (an operation the graph cannot hold), the step runs
uncaptured and says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationConfig

from .compiled_step import wants_compiled_step
from .static_cache import StaticKVCache

logger = logging.getLogger(__name__)

CAPACITY_STEP = 256
"""The cache capacity of a graphed decode is the request's length rounded up to a multiple of this: requests within
one bucket share the compiled code (masked slots cost attention over at most this many extra keys)."""

_WARMUP_CALLS = 2  # before a capture, as torch's documentation asks (lazy initialisation of kernels and workspaces)
_capture_failure_reported = False


def wants_cuda_graph(model: torch.nn.Module, config: GenerationConfig, device: torch.device) -> bool:
    """Whether the one-token steps of this request run as a captured CUDA graph (see the module docstring)."""
    text = model.config.get_text_config()
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        device.type == "cuda"
        and wants_compiled_step(config)
        and getattr(model, "cuda_graph_decode", True)
        and not model.config.is_encoder_decoder
        and getattr(text, "sliding_window", None) is None
        # routed experts take data-dependent rows, and dynamic or long rope rescales by the positions' values: both
        # read the device between tokens, which a graph cannot hold
        and getattr(text, "moe", None) is None
        and "dynamic" not in rope and rope != "longrope"
    )


def graph_capacity(max_length: int) -> int:
    """The cache capacity of a graphed decode of ``max_length`` tokens: rounded up to :data:`CAPACITY_STEP`."""
    return -(-max_length // CAPACITY_STEP) * CAPACITY_STEP


class StaticShapeStep:
    """The one-token decode step over inputs of fixed shapes and addresses, replayed from a CUDA graph when
    ``capture`` (else called directly: the same computation, which is how the CPU tests it).

    Args:
        forward: the model's forward (compiled, or the model itself).
        cache: the cache the prompt filled; it is switched to slot mode here.
        tokens: the (B, max_length) buffer of the decode loop (prompt, then the chosen tokens).
        positions: the (B, max_length) position ids of every token.
        prompt_mask: the prompt's padding mask (B, prompt) or None when no row is padded.
        capture: record the step in a CUDA graph at its first call and replay it afterwards.
    """

    def __init__(self, forward: Callable[..., Any], cache: StaticKVCache, tokens: torch.Tensor,
                 positions: torch.Tensor, prompt_mask: torch.Tensor | None, capture: bool) -> None:
        batch, prompt_length = tokens.shape[0], cache.get_seq_length()
        capacity = cache.layers[0].max_cache_len
        device = tokens.device
        self.forward, self.cache, self.tokens, self.all_positions = forward, cache, tokens, positions
        self.capture = capture
        self.ids = tokens.new_zeros(batch, 1)
        self.positions = positions.new_zeros(batch, 1)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, 1, 1, capacity, dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :prompt_length] = True if prompt_mask is None else prompt_mask.bool()
        cache.write_at(self.slot)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None

    def __call__(self, length: int) -> Any:
        """The model output for the token at ``length - 1`` (the last one chosen)."""
        self.ids.copy_(self.tokens[:, length - 1:length])
        self.positions.copy_(self.all_positions[:, length - 1:length])
        self.slot.fill_(length - 1)
        self.mask[..., length - 1] = True  # the key written by this step
        if not self.capture:
            return self._run()
        if self.graph is None:
            self._record()
            if self.graph is None:  # the capture failed: run uncaptured from now on
                return self._run()
        self.graph.replay()
        return self.out

    def _run(self) -> Any:
        return self.forward(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions,
                            past_key_values=self.cache, use_cache=True)

    def _record(self) -> None:
        """Warm the step up on a side stream, then capture it. Each warm-up call writes the same key and value into
        the same slot as the real step will, so it changes nothing."""
        global _capture_failure_reported
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(_WARMUP_CALLS):
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.out = self._run()
        except RuntimeError as err:
            self.capture, self.out = False, None
            if not _capture_failure_reported:
                _capture_failure_reported = True
                logger.warning("the decode step could not be captured in a CUDA graph (%s); it runs uncaptured",
                               str(err).splitlines()[0] if str(err) else type(err).__name__)
            return
        self.graph = graph
