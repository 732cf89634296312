"""The lean decode loop for encoder-decoder models (T5), token-identical to ``GenerationMixin``'s.

The source is encoded once (by the model's ``get_encoder()``, as ``GenerationMixin`` does), its rows repeated for
``num_return_sequences``; then each step feeds the last chosen token through the decoder with an
``EncoderDecoderCache``: the self-attention keys/values in a preallocated
:class:`~mindformers_py.generation.StaticKVCache`, the cross-attention ones computed at the first step and reused.
The decoder rows are never padded (they all begin with the start token), so steps need no decoder mask; the
source's padding becomes one boolean key mask made before the loop. Token choice, eos/pad handling and stopping
are the decoder-only loop's (:mod:`~mindformers_py.generation.fast_generate`), prepared by transformers' own
helpers with the decoder's lengths (a start token, then the new tokens).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationConfig
from transformers.modeling_outputs import BaseModelOutput

from .fast_generate import _processor_steps, _StopRule
from .skinny_linear import skinny_linear_kernels
from .static_cache import StaticKVCache


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
) -> torch.LongTensor:
    """Decode: the same token choice, eos/pad handling and stopping rule as ``GenerationMixin._sample``; returns the
    decoder sequences (start token included), ``expand`` rows per source row."""
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

        def forward(length: int):
            return model(encoder_outputs=encoded, attention_mask=keys_mask, decoder_input_ids=tokens[:, length - 1:length],
                         past_key_values=cache, use_cache=True)

        length = 1
        out = forward(length)
        with skinny_linear_kernels(_per_step_layers(model), batch, steps=max_length - 2):
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
                    break
                out = forward(length)
    if streamer is not None:
        streamer.end()
    return tokens if length == max_length else tokens[:, :length].contiguous()


def _per_step_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The layers every decoding step runs, for the skinny kernels (which copy each one's weight for one-row
    steps): the decoder's and the output head's, but not the encoder's nor the cross-attention key/value
    projections, which ran once before the loop."""
    once = {id(m) for a in model.get_decoder().modules() if getattr(a, "cross_attention", False)
            for m in (a.k_proj, a.v_proj)}
    decoder = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear) and id(m) not in once]
    return torch.nn.ModuleList([*decoder, model.get_output_embeddings()])
