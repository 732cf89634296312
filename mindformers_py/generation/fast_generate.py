"""A lean decode loop behind transformers' ``generate`` API, token-identical to ``GenerationMixin``'s, for
decoder-only and encoder-decoder models (for the latter the encoder runs once: see :func:`decode_seq2seq`).

``FastGenerationMixin.generate`` resolves its arguments exactly as ``GenerationMixin.generate`` does (same
generation config merging, special tokens, attention-mask inference, lengths, logits processors and stopping
criteria, all built by transformers' own helpers). When the request is one the lean loop supports -- greedy or
multinomial sampling with any config-driven processors (temperature, top-k, top-p, repetition penalty, ...),
eos/pad handling, left-padded batches, ``num_return_sequences``, a streamer, and a plain sequences tensor as the
result -- it decodes with a preallocated :class:`~mindformers_py.generation.StaticKVCache` and a handful of tensor
ops per step. Anything else (beam search, assisted decoding, ``return_dict_in_generate``, custom
``logits_processor``/``stopping_criteria`` lists, a cache passed in, ``inputs_embeds``, ...) goes to
``GenerationMixin.generate`` unchanged.

Where the time goes in ``GenerationMixin`` for a small model on CPU: per step it concatenates the cache, the
attention mask and the position ids, re-slices inputs in ``prepare_inputs_for_generation``, runs every logits
processor through ``inspect.signature`` and every stopping criterion through a list. The lean loop keeps the
tokens, positions and decode mask in buffers sized once, so a step is one model forward (under
``torch.inference_mode``, with the skinny-GEMM kernels of :mod:`~mindformers_py.generation.skinny_linear`) plus the
token choice. The model forward itself is the same code as in training and in ``GenerationMixin``'s path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import logging

from ..errors import ConfigError, MindFormersError
from .compiled_step import compiled_forward, wants_compiled_step
from .graphed_step import StaticShapeStep, graph_capacity, wants_cuda_graph
from .skinny_linear import skinny_linear_kernels
from .static_cache import StaticKVCache

logger = logging.get_logger(__name__)

_LEAN_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# Model inputs the lean loop builds itself; any other model kwarg (a cache, embeddings, position ids, output
# flags, ...) means the caller wants something only GenerationMixin handles.
_LEAN_MODEL_KWARGS = frozenset({"input_ids", "attention_mask", "use_cache"})
# Keyword arguments GenerationMixin.generate takes out of **kwargs before building the generation config.
_GENERATION_MODE_KWARGS = ("tokenizer", "assistant_tokenizer", "trust_remote_code")


def check_context_length(
    prompt_length: int, max_length: int, context_length: int | None, max_new_tokens: int | None = None
) -> None:
    """Raise a one-line :class:`MindFormersError` when the prompt, or the prompt and its new tokens, exceed the context.

    Args:
        prompt_length: tokens in the prompt.
        max_length: prompt plus new tokens, as the generation will run.
        context_length: the model's ``max_position_embeddings`` (``None``: no limit).
        max_new_tokens: the requested number of new tokens, named in the message when given.
    """
    if context_length is None:
        return
    new = max_new_tokens if max_new_tokens is not None else max_length - prompt_length
    if prompt_length >= context_length:
        raise MindFormersError(
            f"the prompt has {prompt_length} tokens, which leaves no room in the model's context length of {context_length} "
            f"tokens (max_position_embeddings) for max_new_tokens={new}; shorten the prompt"
        )
    if max_length > context_length:
        raise MindFormersError(
            f"prompt of {prompt_length} tokens + max_new_tokens={new} = {prompt_length + new} tokens exceeds the model's "
            f"context length of {context_length} tokens (max_position_embeddings); shorten the prompt or lower "
            f"max_new_tokens to at most {context_length - prompt_length}"
        )


def position_limit(config: Any) -> int | None:
    """The longest sequence a model's positions can number: its config's ``position_limit`` (None for rotary or
    relative positions, which have no end), else ``max_position_embeddings``."""
    if hasattr(config, "position_limit"):
        return config.position_limit
    return getattr(config, "max_position_embeddings", None)


class FastGenerationMixin(GenerationMixin):
    """``GenerationMixin`` whose ``generate`` runs a lean static-cache loop when it can, with identical results.

    Set ``model.fast_generate = False`` (or pass ``fast_generate=False`` to ``generate``) to force transformers'
    own decoding path, e.g. to compare the two.
    """

    fast_generate: bool = True
    """Use the lean decode loop for the requests it supports (otherwise always ``GenerationMixin``'s loop)."""
    cuda_graph_decode: bool = True
    """On a CUDA device, capture the compiled decode step (``cache_implementation="static"``) in a CUDA graph and
    replay it for every token (:mod:`mindformers_py.generation.graphed_step`); False runs the compiled step
    without a graph."""

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        prefix_allowed_tokens_fn=None,
        synced_gpus: bool | None = None,
        assistant_model=None,
        streamer=None,
        negative_prompt_ids: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        custom_generate=None,
        fast_generate: bool | None = None,
        **kwargs: Any,
    ):
        """transformers' ``generate`` (same arguments and results), plus ``fast_generate`` to choose the loop.

        Before decoding, a prompt that with ``max_new_tokens`` would run past ``max_position_embeddings`` raises a
        :class:`MindFormersError` naming the prompt length, ``max_new_tokens`` and the context length.
        """
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        request = None
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point():
            # Raises if the request cannot fit the context; None if transformers' private helpers changed.
            request = _guarded(self._resolve_request, input_ids, generation_config, kwargs)
        lean_arguments = (
            not logits_processor and not stopping_criteria and prefix_allowed_tokens_fn is None and not synced_gpus
            and assistant_model is None and negative_prompt_ids is None and negative_prompt_attention_mask is None
            and custom_generate is None and (inputs is None or "input_ids" not in kwargs)
        )
        if request is not None and lean_arguments and (self.fast_generate if fast_generate is None else fast_generate):
            config, model_kwargs, has_default_max_length = request
            if set(model_kwargs) <= _LEAN_MODEL_KWARGS and _lean_supports(self, config, input_ids, model_kwargs):
                mask, tokenizer = model_kwargs.get("attention_mask"), kwargs.get("tokenizer")
                graphed = wants_cuda_graph(self, config, input_ids.device)
                step = _step_function(self, config, static_shapes=graphed)
                if self.config.is_encoder_decoder:
                    plan = _guarded(seq2seq_setup, self, input_ids, mask, config, has_default_max_length, tokenizer)
                    if plan is not None:
                        return decode_seq2seq(self, *plan, streamer, step)
                else:
                    plan = _guarded(self._lean_setup, input_ids, mask, config, has_default_max_length, tokenizer)
                    if plan is not None:
                        return _decode(self, *plan, streamer, step, static_shapes=graphed, capture=graphed)
        return super().generate(
            inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn, synced_gpus,
            assistant_model, streamer, negative_prompt_ids, negative_prompt_attention_mask, custom_generate, **kwargs,
        )

    def _resolve_request(
        self, input_ids: torch.Tensor, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
    ) -> tuple[GenerationConfig, dict[str, Any], bool]:
        """The generation config exactly as ``GenerationMixin.generate`` builds it (lengths included), the model
        kwargs, and whether ``max_length`` is the default; checks that the request fits the context."""
        has_default_max_length = (
            kwargs.get("max_length") is None
            and (generation_config is None or generation_config.max_length is None)
            and self.generation_config.max_length is None
        )
        has_default_min_length = (
            kwargs.get("min_length") is None
            and (generation_config is None or generation_config.min_length is None)
            and self.generation_config.min_length is None
        )
        config_kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATION_MODE_KWARGS}
        config, model_kwargs = self._prepare_generation_config(generation_config, **config_kwargs)
        if self.config.is_encoder_decoder:
            return self._resolve_seq2seq_request(input_ids, config, model_kwargs, has_default_max_length,
                                                 has_default_min_length)
        prompt_length = input_ids.shape[1]
        config = self._prepare_generated_length(
            config, has_default_max_length, has_default_min_length, "input_ids", prompt_length, input_ids
        )
        check_context_length(
            prompt_length, config.max_length, position_limit(self.config), config.max_new_tokens
        )
        return config, model_kwargs, has_default_max_length

    def _resolve_seq2seq_request(
        self, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any],
        has_default_max_length: bool, has_default_min_length: bool,
    ) -> tuple[GenerationConfig, dict[str, Any], bool]:
        """:meth:`_resolve_request` of an encoder-decoder: ``input_ids`` is the source; lengths count the decoder's
        tokens (its start token and the new ones), as ``GenerationMixin`` does. Refuses, in one line, a model with
        no decoder start token and a source or target longer than ``max_position_embeddings``."""
        if config.decoder_start_token_id is None and config.bos_token_id is None:
            raise ConfigError("decoder_start_token_id is None (and there is no bos_token_id): an encoder-decoder cannot "
                              "start decoding; set decoder_start_token_id in the model's config or generation config")
        limit = position_limit(self.config)
        if limit is not None and input_ids.shape[1] > limit:
            raise MindFormersError(f"the source has {input_ids.shape[1]} tokens, more than the model's limit "
                                   f"max_position_embeddings={limit}; truncate it (truncation=True, max_length={limit})")
        start_length = model_kwargs["decoder_input_ids"].shape[1] if "decoder_input_ids" in model_kwargs else 1
        config = self._prepare_generated_length(
            config, has_default_max_length, has_default_min_length, "input_ids", start_length, input_ids
        )
        if limit is not None and config.max_length > limit:
            raise MindFormersError(f"max_new_tokens={config.max_length - start_length} + {start_length} decoder start "
                                   f"token(s) exceeds the model's target limit max_position_embeddings={limit}; lower "
                                   f"max_new_tokens to at most {limit - start_length}")
        return config, model_kwargs, has_default_max_length

    def _lean_setup(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        config: GenerationConfig,
        has_default_max_length: bool,
        tokenizer,
    ) -> tuple:
        """What the lean loop needs, prepared by transformers' own helpers: the (expanded) prompt, its mask (None if
        unpadded) and positions, the length limit, logits processors, stopping criteria, the sampling flag and the
        pad token. Has no side effect, so a failure here (a changed private helper) can fall back cleanly."""
        device = input_ids.device
        batch, prompt_length = input_ids.shape
        self._prepare_special_tokens(config, attention_mask is not None, device=device, batch_size=batch)
        pad = config._pad_token_tensor
        if batch > 1 and pad is not None:
            right_padded = attention_mask[:, -1] == 0 if attention_mask is not None else input_ids[:, -1] == pad
            if bool(right_padded.any()):
                logger.warning(
                    "A decoder-only architecture is being used, but right-padding was detected! For correct generation "
                    "results, please set `padding_side='left'` when initializing the tokenizer."
                )
        if attention_mask is None:
            attention_mask = self._prepare_attention_mask_for_generation(input_ids, config, {})
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        padded = not bool((attention_mask == 1).all())
        prompt = input_ids
        expand = max(config.num_beams or 1, config.num_return_sequences or 1)
        if expand > 1:
            input_ids, attention_mask, position_ids = (
                t.repeat_interleave(expand, dim=0) for t in (input_ids, attention_mask, position_ids)
            )
        self._validate_generated_length(config, prompt_length, has_default_max_length)
        processors = self._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_length, encoder_input_ids=prompt,
            prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device,
            model_kwargs={"attention_mask": attention_mask if padded else None},
        )
        criteria = self._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=tokenizer)
        return (input_ids, attention_mask if padded else None, position_ids, config.max_length, processors, criteria,
                config.do_sample, pad)


# Errors a changed private transformers helper raises (renamed: AttributeError; new signature: TypeError).
_DRIFT_ERRORS = (AttributeError, TypeError)
_drift_reported = False


def _guarded(step, *args):
    """``step(*args)``, or None when it fails the way a changed private transformers helper would: then generate
    takes ``GenerationMixin``'s own path (which raises the error again if it was the caller's). Reported once."""
    global _drift_reported
    try:
        return step(*args)
    except _DRIFT_ERRORS as err:
        if not _drift_reported:
            logger.warning("the lean decode loop cannot use this transformers version's generation helpers (%s: %s); "
                           "generate runs GenerationMixin's loop", type(err).__name__, err)
            _drift_reported = True
        return None


def _lean_supports(
    model: torch.nn.Module, config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict[str, Any]
) -> bool:
    """Whether the lean loop reproduces ``GenerationMixin`` for this request (else it falls back)."""
    mask = model_kwargs.get("attention_mask")
    return (
        # peft's prompt learning (and others) patch prepare_inputs_for_generation on the instance to add their
        # virtual tokens; only GenerationMixin's loop calls it.
        "prepare_inputs_for_generation" not in vars(model)
        and config.get_generation_mode() in _LEAN_MODES
        and not config.return_dict_in_generate
        and config.use_cache
        and config.cache_implementation in (None, "static")  # "static": the compiled step (compiled_step)
        and config.prefill_chunk_size is None
        and not config.token_healing
        and config.guidance_scale in (None, 1)
        and not config.is_assistant
        and input_ids.device == model.device
        and (mask is None or (mask.shape == input_ids.shape and mask.device == input_ids.device))
    )


def _step_function(model: torch.nn.Module, config: GenerationConfig,
                   static_shapes: bool = False) -> Callable[..., Any] | None:
    """The compiled forward the decode steps call when the request asks for it (:mod:`.compiled_step`; with
    ``static_shapes``, the one a CUDA graph captures), else None (the model itself)."""
    if not wants_compiled_step(config):
        return None
    return compiled_forward(model, config.compile_config, static_shapes=static_shapes)


def _processor_steps(processors: LogitsProcessorList) -> list:
    """The processors to call per step: each one directly when they all take only ``(input_ids, scores)``
    (``LogitsProcessorList.__call__`` inspects every signature at every step), else the list itself."""
    if all(len(inspect.signature(p.__call__).parameters) <= 2 for p in processors):
        return list(processors)
    return [processors]


class _DecodeInputs:
    """Token, position and mask buffers sized once for the whole generation; each step reads slices of them.

    ``tokens`` (B, L) holds the prompt, then each chosen token; ``positions`` (B, L) the position ids (left-padded
    rows count from their first real token, as ``GenerationMixin`` does); the decode mask exists only for padded rows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor,
        max_length: int,
    ) -> None:
        batch, prompt_length = input_ids.shape
        device = input_ids.device
        self.tokens = input_ids.new_empty(batch, max_length)
        self.tokens[:, :prompt_length] = input_ids
        new_positions = torch.arange(1, max_length - prompt_length + 1, device=device)
        self.positions = torch.cat([position_ids, position_ids[:, -1:] + new_positions], dim=1)
        self.mask = None
        if attention_mask is not None and getattr(model.config, "sliding_window", None) is None:
            # A one-token step may attend to every real key before it, so the padding mask alone is its whole mask:
            # kept as a ready (B, 1, 1, L) boolean mask and sliced, instead of being rebuilt from a 2D mask each step.
            self.mask = torch.ones(batch, 1, 1, max_length, dtype=torch.bool, device=device)
            self.mask[:, 0, 0, :prompt_length] = attention_mask.bool()
        elif attention_mask is not None:  # the model adds the window to the 2D mask itself
            self.mask = torch.ones(batch, max_length, dtype=attention_mask.dtype, device=device)
            self.mask[:, :prompt_length] = attention_mask

    def step(self, length: int) -> dict[str, torch.Tensor | None]:
        """Model inputs for feeding the token at ``length - 1`` (the last one chosen)."""
        mask = None if self.mask is None else self.mask[..., :length]
        return {
            "input_ids": self.tokens[:, length - 1 : length],
            "attention_mask": mask,
            "position_ids": self.positions[:, length - 1 : length],
        }


class _StopRule:
    """``GenerationMixin``'s end-of-sequence handling: finished rows are padded, and decoding stops when every row
    has produced eos or met another stopping criterion (the length limit is the loop's own bound)."""

    def __init__(self, criteria: StoppingCriteriaList, pad: torch.Tensor | None, batch: int, device: torch.device) -> None:
        eos_criteria = [c for c in criteria if isinstance(c, EosTokenCriteria)]
        self.eos = eos_criteria[0].eos_token_id if eos_criteria else None
        self.others = [c for c in criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
        self.pad = pad
        # One row and eos only: the row is never padded (decoding stops at its eos), and a Python set lookup suffices.
        self.single_row_eos = set(self.eos.tolist()) if self.eos is not None and batch == 1 and not self.others else None
        self.tracks_rows = (self.eos is not None or bool(self.others)) and self.single_row_eos is None
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)

    def pad_finished(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """``next_tokens`` with the rows that already finished replaced by the pad token."""
        if self.tracks_rows and self.eos is not None:
            return torch.where(self.unfinished, next_tokens, self.pad)
        return next_tokens

    def done(self, next_tokens: torch.Tensor, tokens: torch.Tensor) -> bool:
        """Update the finished rows with the tokens just chosen (``tokens`` ends with them); True when all finished."""
        if self.single_row_eos is not None:
            return next_tokens.item() in self.single_row_eos
        if not self.tracks_rows:
            return False
        if self.eos is not None:
            self.unfinished &= ~torch.isin(next_tokens, self.eos)
        for criterion in self.others:
            self.unfinished &= ~criterion(tokens, None)
        return not bool(self.unfinished.any())


def _decode(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor,
    max_length: int,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
    do_sample: bool,
    pad: torch.Tensor | None,
    streamer,
    step: Callable[..., Any] | None = None,
    static_shapes: bool = False,
    capture: bool = False,
) -> torch.LongTensor:
    """The decode loop: the same token choice, eos/pad handling and stopping rule as ``GenerationMixin._sample``.

    ``attention_mask`` is None when no row is padded; ``position_ids`` (B, prompt) are the prompt positions.
    ``step`` replaces the model for the one-token steps after the prompt (the compiled forward). With
    ``static_shapes`` those steps see fixed shapes and addresses (:class:`~.graphed_step.StaticShapeStep`: the
    whole cache, masked), and with ``capture`` they are replayed from a CUDA graph.
    """
    batch, prompt_length = input_ids.shape
    if streamer is not None:
        streamer.put(input_ids.cpu())
    # Buffers handed back to the caller are made outside inference mode, so they stay ordinary tensors.
    inputs = _DecodeInputs(model, input_ids, attention_mask, position_ids, max_length)
    stop = _StopRule(criteria, pad, batch, input_ids.device)
    tokens = inputs.tokens
    steps = _processor_steps(processors)
    with torch.inference_mode():
        capacity = graph_capacity(max_length) if static_shapes else max_length
        cache = StaticKVCache(model.config.get_text_config().num_hidden_layers, capacity)
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=inputs.positions[:, :prompt_length],
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        forward = model if step is None else step
        if static_shapes:
            one_token = StaticShapeStep(forward, cache, tokens, inputs.positions, attention_mask, capture)
        else:
            one_token = lambda n: forward(**inputs.step(n), past_key_values=cache, use_cache=True)  # noqa: E731
        # The skinny kernels serve compiled steps too: dynamo traces their forwards, taking the per-call weight copies
        # as graph inputs, so later calls reuse the graph.
        with skinny_linear_kernels(model, batch, steps=max_length - prompt_length - 1):
            length = _choose_tokens(out, one_token, tokens, prompt_length, max_length, steps, do_sample, stop,
                                    streamer)
    return _finished(tokens, length, max_length, streamer)


def _choose_tokens(out: Any, forward: Callable[[int], Any], tokens: torch.Tensor, length: int, max_length: int,
                   steps: list, do_sample: bool, stop: _StopRule, streamer) -> int:
    """The token loop of both decoders: from the logits of ``out``, choose the next token of every row (processors,
    then greedy or sampling), write it into ``tokens`` at ``length``, stream it, stop by ``stop`` or at
    ``max_length``, else run ``forward(new length)`` for the next logits. Returns the final length."""
    while True:
        scores = out.logits[:, -1].float()  # (B, V)
        for step in steps:
            scores = step(tokens[:, :length], scores)
        if do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        tokens[:, length] = stop.pad_finished(next_tokens)
        length += 1
        if streamer is not None:
            streamer.put(tokens[:, length - 1].cpu())
        if length >= max_length or stop.done(tokens[:, length - 1], tokens[:, :length]):
            return length
        out = forward(length)


def _finished(tokens: torch.Tensor, length: int, max_length: int, streamer) -> torch.LongTensor:
    """Close the streamer; the sequences cut to the length reached."""
    if streamer is not None:
        streamer.end()
    return tokens if length == max_length else tokens[:, :length].contiguous()

# -- encoder-decoders ---------------------------------------------------------------------------------------------
# The source is encoded once (by the model's ``get_encoder()``, as ``GenerationMixin`` does), its rows repeated for
# ``num_return_sequences``; then each step feeds the last chosen token through the decoder with an
# ``EncoderDecoderCache``: the self-attention keys/values in a preallocated StaticKVCache, the cross-attention ones
# computed at the first step and reused. The decoder rows are never padded (they all begin with the start token), so
# steps need no decoder mask; the source's padding becomes one boolean key mask made before the loop. Token choice,
# eos/pad handling and stopping are the decoder-only loop's, prepared by transformers' own helpers with the
# decoder's lengths (a start token, then the new tokens).


def seq2seq_setup(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    config: GenerationConfig,
    has_default_max_length: bool,
    tokenizer,
) -> tuple:
    """What :func:`decode_seq2seq` needs, prepared as ``GenerationMixin.generate`` prepares it for an
    encoder-decoder: the source and its mask (inferred from the pad token when not given), the decoder start token,
    how many sequences per source row, the length limit (decoder tokens), logits processors (seeing the source as
    ``encoder_input_ids``), stopping criteria, the sampling flag and the pad token. No side effect."""
    device = input_ids.device
    model._prepare_special_tokens(config, attention_mask is not None, device=device, batch_size=input_ids.shape[0])
    model._validate_generated_length(config, 1, has_default_max_length)
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=1, encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(), device=device,
        model_kwargs={} if attention_mask is None else {"attention_mask": attention_mask},
    )
    if attention_mask is None:  # GenerationMixin infers no source mask for encoder-decoders: every token is seen
        attention_mask = torch.ones_like(input_ids)
    criteria = model._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=tokenizer)
    expand = max(config.num_beams or 1, config.num_return_sequences or 1)
    return (input_ids, attention_mask, config._decoder_start_token_tensor, expand, config.max_length, processors,
            criteria, config.do_sample, config._pad_token_tensor)


def decode_seq2seq(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    start: torch.Tensor,
    expand: int,
    max_length: int,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
    do_sample: bool,
    pad: torch.Tensor | None,
    streamer,
    step: Callable[..., Any] | None = None,
) -> torch.LongTensor:
    """Decode: the same token choice, eos/pad handling and stopping rule as ``GenerationMixin._sample``; returns the
    decoder sequences (start token included), ``expand`` rows per source row. ``step`` replaces the model for the
    steps after the first (which computes the cross-attention keys and values): the compiled forward."""
    batch = input_ids.shape[0] * expand
    device = input_ids.device
    # Buffers handed back to the caller are made outside inference mode, so they stay ordinary tensors.
    tokens = input_ids.new_empty(batch, max_length)
    tokens[:, :1] = start.view(-1, 1) if start.dim() > 0 else start
    if streamer is not None:
        streamer.put(tokens[:, :1].cpu())
    stop = _StopRule(criteria, pad, batch, device)
    steps = _processor_steps(processors)
    padded = not bool(attention_mask.all())
    with torch.inference_mode():
        hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        source_mask = attention_mask
        if expand > 1:
            hidden, source_mask = hidden.repeat_interleave(expand, dim=0), source_mask.repeat_interleave(expand, dim=0)
        encoded = BaseModelOutput(last_hidden_state=hidden)
        keys_mask = source_mask.bool()[:, None, None, :] if padded else None  # (B, 1, 1, S)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        cache = EncoderDecoderCache(StaticKVCache(layers, max_length), DynamicCache())

        def forward(length: int, call: Callable[..., Any] = model):  # the prompt's step: the model itself
            return call(encoder_outputs=encoded, attention_mask=keys_mask, decoder_input_ids=tokens[:, length - 1:length],
                        past_key_values=cache, use_cache=True)

        out = forward(1)
        with skinny_linear_kernels(_per_step_layers(model), batch, steps=max_length - 2):
            one_token = model if step is None else step
            length = _choose_tokens(out, lambda n: forward(n, one_token), tokens, 1, max_length, steps, do_sample, stop,
                                    streamer)
    return _finished(tokens, length, max_length, streamer)


def _per_step_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The layers every decoding step runs, for the skinny kernels (which copy each one's weight for one-row
    steps): the decoder's and the output head's, but not the encoder's nor the cross-attention key/value
    projections, which ran once before the loop."""
    once = {id(m) for a in model.get_decoder().modules() if getattr(a, "cross_attention", False)
            for m in (a.k_proj, a.v_proj)}
    decoder = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear) and id(m) not in once]
    return torch.nn.ModuleList([*decoder, model.get_output_embeddings()])
