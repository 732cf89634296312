"""The T5 family: an encoder-decoder transformer built from the shared layers.

Each stack (``encoder``, ``decoder``) is a list of :class:`~mindformers_py.layers.TransformerBlock` with T5's
settings (RMS norms, no biases, unscaled attention; the decoder's blocks carry cross-attention) and one
:class:`~mindformers_py.layers.RelativePositionBias` computed once per forward pass and shared by its layers. The
token embedding ``shared`` feeds both stacks and, in T5 v1, the LM head (whose input is then scaled by
``hidden_size ** -0.5``).

Every model is also its own pipeline stage: a stage is the model with the parts it does not hold set to None. The
first stage holds ``shared`` and both position biases, so it embeds the encoder's and the decoder's inputs and
computes both biases; the encoder's layers then the decoder's are split over the stages; the stage of the last
encoder layer holds the encoder's final norm, the last stage the decoder's and the head. Between stages travel the
encoder's hidden states (its output once finished, which every decoder stage attends to), the decoder's hidden
states and the position biases still needed (see :class:`T5Model.forward`'s ``return_position_bias``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ...errors import ConfigError, MindFormersError
from ...generation import FastGenerationMixin
from ...layers import Attention, RelativePositionBias, RMSNorm, TransformerBlock, additive_mask, \
    build_attention_mask
from ...layers.dropout import Dropout
from ...layers.heads import kept_positions
from ...layers.masks import key_padding_mask
from ...layers.loss import IGNORE_INDEX, token_cross_entropy
from ..cache_names import CACHE_NAMES, accepts_cache_argument, cache_output, output_cache
from ..modeling_base import MindFormersPreTrainedModel
from .configuration_t5 import T5Config

logger = logging.getLogger(__name__)


@dataclass
class T5StackOutput(BaseModelOutputWithPastAndCrossAttentions):
    """A stack's output; ``position_bias`` (1, nh, T, S) is the stack's relative position bias before masking,
    returned only when asked for (a pipeline stage hands it to the next)."""

    position_bias: torch.FloatTensor | None = None


@dataclass
class T5ModelOutput(Seq2SeqModelOutput):
    """transformers' ``Seq2SeqModelOutput`` plus the stacks' position biases, set only with
    ``return_position_bias=True`` (pipeline stages)."""

    encoder_position_bias: torch.FloatTensor | None = None
    decoder_position_bias: torch.FloatTensor | None = None


class T5PreTrainedModel(MindFormersPreTrainedModel):
    """Weight init (T5's: each matrix ~ N(0, factor · fan_in^-0.5)) and the outputs transformers records."""

    config_class = T5Config
    config: T5Config
    base_model_prefix = "model"
    # transformers' T5 keeps its feed-forward output projection ("wo") in float32 when loaded in float16: its
    # activations overflow float16 (and the MLP casts its hidden states to that projection's dtype).
    _keep_in_fp32_modules = ["down_proj"]
    _can_record_outputs = {
        "hidden_states": TransformerBlock,
        "attentions": OutputRecorder(Attention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(Attention, index=1, layer_name="cross_attn"),
    }

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        factor = self.config.initializer_factor
        d_model, d_ff = self.config.hidden_size, self.config.intermediate_size
        inner = self.config.num_attention_heads * self.config.head_dim
        if isinstance(module, RMSNorm):
            init.constant_(module.weight, factor)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            std = {"q_proj": factor * (d_model * self.config.head_dim) ** -0.5, "k_proj": factor * d_model**-0.5,
                   "v_proj": factor * d_model**-0.5, "o_proj": factor * inner**-0.5,
                   "gate_proj": factor * d_model**-0.5, "up_proj": factor * d_model**-0.5,
                   "down_proj": factor * d_ff**-0.5, "relative_attention_bias": factor * d_model**-0.5,
                   }.get(self.weight_role(module), factor)  # the shared embedding and an untied head: N(0, factor)
            init.normal_(module.weight, 0.0, std)

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs from labels: ``decoder_start_token_id`` in front, the labels shifted one step right, -100
        replaced by the pad id (transformers' T5 rule)."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None:
            raise ConfigError("decoder_start_token_id is None: the decoder inputs cannot be made from the labels; set "
                              "config.decoder_start_token_id (T5 uses the pad id, 0)")
        if pad is None:
            raise ConfigError("pad_token_id is None: the -100 labels cannot become decoder inputs; set config.pad_token_id")
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


class T5Stack(T5PreTrainedModel):
    """One stack of T5 layers: the encoder (bidirectional) or the decoder (causal, cross-attending to the encoder
    output). Like transformers' ``T5Stack`` it embeds ``input_ids`` with the model's shared embedding
    (:attr:`embed_tokens`) and takes its own attention masks, so ``model.get_encoder()`` / ``get_decoder()`` are
    called as there. Its own transformers model so that each stack records its own ``hidden_states``/``attentions``
    (transformers' T5 does the same).

    Parts: ``position_bias`` (None on pipeline stages after the first: the bias then comes from the previous
    stage), ``drop`` (the dropout of the embedding phase), ``layers``, ``norm`` and ``final_dropout`` (None before
    the stage holding the stack's last layer).
    """

    def __init__(self, config: T5Config, is_decoder: bool, owner: nn.Module | None = None) -> None:
        super().__init__(config)
        self.is_decoder = is_decoder
        # The model holding the shared embedding: a plain reference, not a submodule (the embedding is saved once, as
        # the model's ``shared``), read at every call so that a pipeline stage without it sees None.
        object.__setattr__(self, "_owner", owner)
        count = config.num_decoder_layers if is_decoder else config.num_hidden_layers
        self.position_bias = RelativePositionBias(config.num_attention_heads, config.relative_attention_num_buckets,
                                                  config.relative_attention_max_distance, bidirectional=not is_decoder)
        self.drop = Dropout(config.dropout_rate)
        self.layers = nn.ModuleList(
            TransformerBlock(config, i, is_causal=is_decoder, cross_attention=is_decoder) for i in range(count)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps, cast_to_weight_dtype=True)
        self.final_dropout = Dropout(config.dropout_rate)
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def embed_tokens(self) -> nn.Embedding | None:
        """The token embedding the stack embeds ``input_ids`` with: the owning model's ``shared`` (None on a
        pipeline stage without it, or for a stack built alone)."""
        return getattr(self._owner, "shared", None)

    def get_input_embeddings(self) -> nn.Embedding | None:
        return self.embed_tokens

    def init_parallel_plans(self) -> None:
        """No plans of its own: the config's plans are :class:`T5Model`'s, which holds both stacks."""
        super().init_parallel_plans()
        self._tp_plan, self._pp_plan, self._ep_plan, self._fsdp_plan = {}, {}, {}, {}

    @accepts_cache_argument
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        position_bias: torch.Tensor | None = None,
        return_position_bias: bool = False,
        **kwargs,
    ) -> T5StackOutput:
        """The stack over ``input_ids`` (or ``inputs_embeds``), as transformers' ``T5Stack``: embedded, dropout,
        the layers, the final norm. ``attention_mask`` (B, T) marks real tokens; ``encoder_hidden_states`` (B, S, C)
        and ``encoder_attention_mask`` (B, S) are what the decoder attends to; ``past_key_values`` an
        ``EncoderDecoderCache`` (decoder only). On a pipeline stage without the embedding, ``inputs_embeds`` are the
        previous stage's hidden states, taken as they are, and ``position_bias`` the stack's unmasked bias the first
        stage computed (``return_position_bias`` hands it on)."""
        hidden_states = self._embed(input_ids, inputs_embeds)
        length = hidden_states.shape[1]
        if self.is_decoder:  # as transformers' decoder stack, which opens its own cache (get_decoder() called alone)
            use_cache = self.config.use_cache if use_cache is None else use_cache
            if use_cache and past_key_values is None and not self.training:
                past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        past = int(self_cache.get_seq_length()) if self_cache is not None else 0
        if self_cache is not None:
            kv_length, kv_offset = self_cache.get_mask_sizes(length, 0)
        else:
            kv_length, kv_offset = length, 0
        mask = build_attention_mask(attention_mask, query_length=length, kv_length=kv_length, kv_offset=kv_offset,
                                    past_length=past, causal=self.is_decoder, device=hidden_states.device)
        if position_bias is None:
            if self.position_bias is None:
                raise MindFormersError("this pipeline stage holds no position bias: pass the previous stage's as "
                                       "position_bias")
            position_bias = self.position_bias(length, kv_length, past).to(hidden_states.dtype)
        scores_bias = additive_mask(position_bias, mask, causal=self.is_decoder)
        cross_mask = None
        if encoder_hidden_states is not None:
            cross_mask = key_padding_mask(encoder_attention_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, None, None, past_key_values, scores_bias,
                                  encoder_hidden_states, cross_mask)
        if self.norm is not None:
            hidden_states = self.final_dropout(self.norm(hidden_states))
        return T5StackOutput(last_hidden_state=hidden_states, **cache_output(past_key_values if use_cache else None),
                             position_bias=position_bias if return_position_bias else None)

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The embedding phase: token embeddings (or ``inputs_embeds``) and the stack's input dropout. On a pipeline
        stage without the embedding, ``inputs_embeds`` are the previous stage's hidden states, taken as they are."""
        what = "decoder" if self.is_decoder else "encoder"
        embedding = self.embed_tokens
        if embedding is None:
            if inputs_embeds is None:
                raise MindFormersError(f"this {what} stack holds no embedding: pass the embedded inputs (or the previous "
                                       "pipeline stage's hidden states) as inputs_embeds")
            return inputs_embeds
        if (input_ids is None) == (inputs_embeds is None):
            names = "decoder_input_ids / decoder_inputs_embeds" if self.is_decoder else "input_ids / inputs_embeds"
            raise MindFormersError(f"pass exactly one of the {what} token ids or embeddings ({names})")
        return self.drop(embedding(input_ids) if inputs_embeds is None else inputs_embeds)


class T5Model(T5PreTrainedModel):
    """The bare encoder-decoder: ``shared`` embedding, ``encoder`` and ``decoder`` stacks; returns the decoder's
    last hidden states (and the encoder's)."""

    def __init__(self, config: T5Config) -> None:
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = T5Stack(config, is_decoder=False, owner=self)
        self.decoder = T5Stack(config, is_decoder=True, owner=self)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value

    def get_encoder(self, modality: str | None = None) -> T5Stack:
        """The encoder stack (it takes ``input_ids`` and embeds them with ``shared``), as transformers'."""
        return self.encoder

    def get_decoder(self) -> T5Stack:
        """The decoder stack (it takes ``input_ids`` and embeds them with ``shared``), as transformers'."""
        return self.decoder

    def encode(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
               **kwargs) -> T5StackOutput:
        """The encoder stack's output for ``input_ids`` (or ``inputs_embeds``), ``attention_mask`` (B, S)."""
        kwargs.pop("use_cache", None)
        for name in CACHE_NAMES:  # the encoder keeps no cache
            kwargs.pop(name, None)
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                            position_bias=position_bias, **kwargs)

    @accepts_cache_argument
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: tuple | BaseModelOutput | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        encoder_position_bias: torch.Tensor | None = None,
        decoder_position_bias: torch.Tensor | None = None,
        return_position_bias: bool = False,
        **kwargs,
    ) -> T5ModelOutput:
        """The decoder's last hidden states (B, T, C) for ``decoder_input_ids`` attending to the encoding of
        ``input_ids`` (or the given ``encoder_outputs``), with transformers' ``Seq2SeqModelOutput`` fields
        (``encoder_last_hidden_state``, the cache, and hidden states / attentions / cross-attentions when asked).

        Pipeline stages also pass ``encoder_position_bias`` / ``decoder_position_bias`` (the biases the first stage
        computed) and ``return_position_bias=True`` to get them back in the output."""
        if encoder_outputs is None:
            encoder_outputs = self.encode(input_ids, attention_mask, inputs_embeds, encoder_position_bias,
                                          return_position_bias=return_position_bias, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, encoder_hidden_states=encoder_outputs[0],
            encoder_attention_mask=attention_mask, inputs_embeds=decoder_inputs_embeds, past_key_values=past_key_values,
            use_cache=use_cache, position_bias=decoder_position_bias, return_position_bias=return_position_bias, **kwargs,
        )
        return T5ModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_output(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            encoder_position_bias=getattr(encoder_outputs, "position_bias", None) if return_position_bias else None,
            decoder_position_bias=decoder_outputs.position_bias,
        )


class T5ForConditionalGeneration(T5PreTrainedModel, FastGenerationMixin):
    """T5 with a language-modelling head; ``generate`` is transformers' (the encoder runs once, the decoder caches
    self- and cross-attention keys/values in an ``EncoderDecoderCache``), with a lean static-cache loop for greedy
    and sampling requests (:class:`~mindformers_py.generation.FastGenerationMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("lm_head",)

    def __init__(self, config: T5Config) -> None:
        super().__init__(config)
        self.model = T5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.shared = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def get_encoder(self, modality: str | None = None) -> T5Stack:
        return self.model.encoder

    def get_decoder(self) -> T5Stack:
        return self.model.decoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs for ``labels`` (transformers' collators call this): the labels shifted right."""
        return self._shift_right(labels)

    @accepts_cache_argument
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: tuple | BaseModelOutput | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Logits (B, T, V) of the next target token at every decoder position (or the last ``logits_to_keep``);
        with ``labels`` (B, T; -100 ignored) the decoder inputs default to the labels shifted right and the loss is
        their cross-entropy (summed and divided by ``num_items_in_batch`` when given, else the mean)."""
        if labels is not None:
            _warn_pad_labels(labels, self.config.pad_token_id)
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self._shift_right(labels)
        out = self.model(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, past_key_values,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs,
        )
        if self.lm_head is None:  # a pipeline stage before the last hands its hidden states on
            return out
        hidden = kept_positions(out.last_hidden_state, logits_to_keep)
        if self.config.scales_decoder_outputs:  # T5 v1: the tied head sees the output scaled by d_model^-0.5
            hidden = hidden * self.config.hidden_size**-0.5
        logits = self.lm_head(hidden)
        loss = token_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return Seq2SeqLMOutput(
            loss=loss, logits=logits, **cache_output(output_cache(out)),
            decoder_hidden_states=out.decoder_hidden_states, decoder_attentions=out.decoder_attentions,
            cross_attentions=out.cross_attentions, encoder_last_hidden_state=out.encoder_last_hidden_state,
            encoder_hidden_states=out.encoder_hidden_states, encoder_attentions=out.encoder_attentions,
        )


_pad_label_warned = False


def _warn_pad_labels(labels: torch.Tensor, pad: int | None) -> None:
    """Warn once when labels hold the pad id: transformers scores those positions as tokens to predict (only -100
    is ignored), which is rarely meant; collators should replace padding by -100."""
    global _pad_label_warned
    if _pad_label_warned or pad is None or torch.compiler.is_compiling():
        return
    if bool((labels == pad).any()):
        _pad_label_warned = True
        logger.warning("labels contain the pad id %d: those positions are scored as tokens to predict (as in "
                       "transformers, only -100 is ignored); replace padding in labels by -100 (DataCollatorForSeq2Seq "
                       "with label_pad_token_id=-100 does)", pad)


class T5EncoderModel(T5PreTrainedModel):
    """The encoder alone (``shared`` + ``encoder``), for text embeddings and classifiers on top (transformers'
    ``T5EncoderModel``); loads the encoder part of any T5 checkpoint."""

    _keys_to_ignore_on_load_unexpected = [r"^decoder\.", r"^lm_head\."]

    def __init__(self, config: T5Config) -> None:
        # An encoder alone keeps no cache and is no encoder-decoder: its config says so, as transformers' does.
        config.use_cache = False
        config.is_encoder_decoder = False
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = T5Stack(config, is_decoder=False, owner=self)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value

    def get_encoder(self, modality: str | None = None) -> T5Stack:
        return self.encoder

    encode = T5Model.encode

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> BaseModelOutput:
        """The encoder's last hidden states (B, S, C) (with hidden states / attentions when asked)."""
        out = self.encode(input_ids, attention_mask, inputs_embeds, **kwargs)
        return BaseModelOutput(last_hidden_state=out.last_hidden_state, hidden_states=out.hidden_states,
                               attentions=out.attentions)
