"""What context parallelism can and cannot do, checked before any process group or weight exists.

:class:`~mindformers_py.parallel.config.ParallelConfig` calls these: :func:`validate_context_layout` with the config alone (the algorithm and
its group sizes), :func:`validate_context_model` against a model config, and, when known, the task and the tokens
of a sequence. Every refusal is one line naming the field, the value and what would work; what is refused and why:

* **Ulysses** splits the heads of attention over its ranks: the query heads a tensor-parallel rank holds must
  divide by the Ulysses group (``num_attention_heads / model_parallel``). Key/value heads fewer than the group
  (GQA, MQA) are repeated to the query heads before the exchange, so they need not divide.
* **Ring** (and the ring part of **hybrid**) computes attention blockwise with an online softmax and has no
  attention dropout: ``attention_dropout`` must be 0 in training (Ulysses keeps it: its attention is whole).
* A **causal** sequence is cut into ``2 x ring`` chunks for the load-balanced ring (rank i holds chunks i and
  2·ring-1-i, so every rank does the same work), each then split over the Ulysses group: its length must divide by
  ``2 x context_parallel``; a bidirectional one (encoders, ViT) is cut contiguously and must divide by
  ``context_parallel``. Batches of text are right-padded to that multiple on the fly (padding is masked and never
  scored); a model whose every input has a fixed number of tokens (ViT) cannot be padded, so a length that does not
  divide is refused here.
* A **GPT sequence classifier** pools each row's last real token, found from the whole ``input_ids``, which no
  rank holds: refused. Heads over the whole sequence that read hidden states only (BERT's and ViT's pooled
  classifiers, question answering) gather the sequence before the head.
* **Encoder-decoders under pipeline parallelism** hand their position biases from stage to stage as tensors of the
  local chunk, which a context-parallel rank cannot extend to the whole sequence: refused with ``pipeline_stage>1``.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ...utils.config_section import _divisors

# Model types whose sequence is bidirectional (encoders); image models are told apart by fixed_sequence_length and
# encoder-decoders by is_encoder_decoder, so every other text model is a causal decoder.
ENCODER_MODEL_TYPES = ("mindformers_bert", "bert", "roberta")
# Tasks whose head reads more of the batch than the hidden states (the GPT classifier pools by input_ids).
_TOKEN_POOLING_TASKS = ("sequence_classification", "text_classification", "text-classification")


def default_ulysses_degree(cp: int) -> int:
    """The Ulysses group size ``hybrid`` uses by default: the largest divisor of ``cp`` below it (the inner,
    adjacent ranks exchange by all-to-all; the smallest ring spans the groups). 1 when ``cp`` is prime."""
    return max((d for d in _divisors(cp) if d < cp), default=1)


def validate_context_layout(config: Any) -> None:
    """Check the context-parallel fields of ``config`` on their own (``context_parallel_algo`` is already one of
    the choices): the hybrid algorithm needs a Ulysses group size strictly between 1 and ``context_parallel``."""
    cp, algo, ulysses = config.context_parallel, config.context_parallel_algo, config.ulysses_degree_in_cp
    if algo != "hybrid" or cp == 1:
        return
    proper = [d for d in _divisors(cp) if 1 < d < cp]
    if not proper:
        raise ConfigError(f"context_parallel_algo='hybrid' is not valid with context_parallel={cp}: it needs Ulysses "
                          "groups of 2 or more ranks and 2 or more of them (context_parallel 4, 6, 8, ...); choose "
                          "one of: 'ring', 'ulysses'")
    if ulysses is not None and ulysses not in proper:
        raise ConfigError(f"ulysses_degree_in_cp={ulysses} is not valid with context_parallel={cp} and "
                          f"context_parallel_algo='hybrid'; choose one of: {', '.join(map(str, proper))}")


def check_compile(context_parallel: int, torch_compile: bool) -> None:
    """Refuse ``torch_compile`` with context parallelism in one line (checked before workers start and again where
    the layers would be compiled)."""
    if context_parallel > 1 and torch_compile:
        raise ConfigError(f"torch_compile=True is not supported with context_parallel={context_parallel}: the "
                          "context-parallel attention exchanges keys and values between ranks inside each layer, "
                          "which a compiled layer would break into pieces; set torch_compile=false")


def sequence_multiple(config: Any, causal: bool) -> int:
    """The multiple a sequence's length must be under ``config``'s context parallelism: ``2 x context_parallel``
    for a causal sequence on a ring (the load-balanced order), else ``context_parallel``."""
    return 2 * config.cp if causal and config.cp_ring > 1 else config.cp


def is_causal_model(model_config: Any) -> bool | None:
    """Whether a model config's (first) sequence is causal: True for decoder-only language models, False for
    encoders and image models, None for encoder-decoders (a bidirectional source and a causal target)."""
    if getattr(model_config, "is_encoder_decoder", False):
        return None
    if getattr(model_config, "fixed_sequence_length", None) is not None:
        return False
    return getattr(model_config, "model_type", None) not in ENCODER_MODEL_TYPES


def validate_context_model(config: Any, model_config: Any, task: str | None = None,
                           sequence_length: int | None = None) -> None:
    """Check ``config``'s context parallelism against a model config (heads, attention dropout, fixed sequence
    length, pipeline stages of an encoder-decoder), the ``task`` and a ``sequence_length`` when given; a no-op
    without context parallelism."""
    cp = config.cp
    if cp == 1:
        return
    algo, ulysses, tp = config.context_parallel_algo, config.cp_ulysses, config.tp
    heads = getattr(model_config, "num_attention_heads", None)
    if ulysses > 1 and isinstance(heads, int) and (heads // tp) % ulysses:
        group = f"model_parallel*ulysses = {tp}*{ulysses}" if tp > 1 else f"the Ulysses group of {ulysses}"
        fits = [d for d in _divisors(heads // tp) if d > 1 and (d == cp or algo == "hybrid")]
        raise ConfigError(f"context_parallel_algo={algo!r} splits the model's num_attention_heads={heads} over {group} "
                          f"ranks, which does not divide them; choose a context_parallel (or ulysses_degree_in_cp) "
                          f"dividing {heads // tp}{f' ({fits})' if fits else ''}, or context_parallel_algo='ring'")
    dropout = getattr(model_config, "attention_dropout", 0.0) or 0.0
    if config.cp_ring > 1 and isinstance(dropout, (int, float)) and dropout > 0:
        raise ConfigError(f"attention_dropout={dropout} is not supported with context_parallel_algo={algo!r}: ring "
                          "attention merges blockwise softmaxes without dropout; set attention_dropout=0 (T5: "
                          "dropout_rate=0) or use context_parallel_algo='ulysses'")
    if getattr(model_config, "is_encoder_decoder", False) and config.pp > 1:
        raise ConfigError(f"context_parallel={cp} is not supported with pipeline_stage={config.pp} for an "
                          "encoder-decoder: its stages hand on position biases of the local chunk, which a "
                          "context-parallel rank cannot extend to the whole sequence; use pipeline_stage=1")
    if task in _TOKEN_POOLING_TASKS and is_causal_model(model_config):
        raise ConfigError(f"context_parallel={cp} is not supported for a GPT sequence classifier: it pools each row's "
                          "last real token, found from the whole input_ids, which no context-parallel rank holds; "
                          "use context_parallel=1 (encoders' pooled classifiers are supported)")
    fixed = getattr(model_config, "fixed_sequence_length", None)
    if isinstance(fixed, int) and fixed % cp:
        raise ConfigError(f"context_parallel={cp} does not divide the model's {fixed} tokens per sample (class token "
                          f"+ patches), which cannot be padded; choose a context_parallel dividing {fixed} "
                          f"({', '.join(map(str, _divisors(fixed)[1:]))}) or another image_size/patch_size")
    causal = is_causal_model(model_config)
    if isinstance(sequence_length, int) and fixed is None:
        multiple = sequence_multiple(config, bool(causal))
        if sequence_length % multiple:
            why = (f"2*context_parallel = 2*{cp} = {multiple} (the ring's load-balanced order cuts a causal "
                   f"sequence into 2 x {config.cp_ring} chunks)") if multiple > cp else f"context_parallel={cp}"
            raise ConfigError(f"sequence length {sequence_length} is not divisible by {why}; choose a length that is "
                              f"a multiple of {multiple}, e.g. {sequence_length + (-sequence_length) % multiple}")
