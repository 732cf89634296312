"""The sections of a task recipe that are not configs of their own (those are the model config,
``TrainingArguments`` and ``ParallelConfig``): where the tokenizer and data come from and what to generate."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError, check_choice
from ..utils.typed_values import coerce_fields

RUN_MODES = ("train", "finetune", "eval", "predict")
DATA_SOURCES = ("stdlib", "files", "megatron", "stdlib_docstrings", "digits", "imagefolder")
TOKENIZER_TYPES = ("bpe", "wordpiece", "t5")
OBJECTIVES = ("span_corruption", "docstrings", "pairs", "instructions")


@dataclass
class TokenizerSection:
    """Which tokenizer the run uses."""

    name_or_path: str | None = None
    """A tokenizer folder; None trains (once, then cached) a byte-level BPE on the training corpus."""
    vocab_size: int = 8192
    """Vocabulary size of the tokenizer trained when ``name_or_path`` is None."""
    type: str = "bpe"
    """Which tokenizer is trained when ``name_or_path`` is None: ``bpe`` (byte-level, GPT-2's), ``wordpiece``
    (BERT's, with ``[CLS]``/``[SEP]``/``[MASK]``, for masked language models) or ``t5`` (byte-level BPE with T5's
    ``<pad>``/``</s>``/``<unk>`` at ids 0-2 and ``extra_ids`` sentinels, for span corruption)."""
    extra_ids: int = 100
    """Sentinel tokens of a ``t5`` tokenizer (``<extra_id_0>`` ...)."""

    def __post_init__(self) -> None:
        check_choice("tokenizer.type", self.type, TOKENIZER_TYPES)


@dataclass
class DataSection:
    """Where training and evaluation text comes from and how it is cut into blocks."""

    source: str = "stdlib"
    """``stdlib`` (the running interpreter's standard library source, split by file), ``files``, ``megatron``
    (pretokenised Megatron indexed datasets named by ``data_path``, read as Megatron-Core's ``GPTDataset`` reads
    them), or ``stdlib_docstrings`` (classification: the standard library's docstrings labelled by their package);
    for images, ``digits`` (scikit-learn's bundled handwritten digits, a fixed 80/20 split) or ``imagefolder``
    (folders of class sub-folders of images)."""
    data_path: list[Any] | str | None = None
    """``source: megatron``: Megatron's ``--data-path``: one prefix of a ``.bin``/``.idx`` pair, several (mixed in
    proportion to their sizes), or ``[weight, prefix, weight, prefix, ...]`` (a weighted blend, Megatron's
    ``BlendedDataset``)."""
    split: str = "969,30,1"
    """``source: megatron``: Megatron's ``--split``, the train / validation / test shares of every prefix's
    documents."""
    train_samples: int | None = None
    """``source: megatron``: training samples to build (Megatron's ``--train-samples``; epochs repeat, reshuffled, as
    needed); None: ``training.max_steps`` x the global batch, or one epoch without ``max_steps``."""
    train_weights: list[float] | None = None
    """``source: files``: one weight per ``train_files`` entry; the entries' blocks (or samples) are mixed in these
    proportions by Megatron's blending rule, repeating an entry whose share exceeds its rows. None: all rows once."""
    reset_position_ids: bool = False
    """Causal LM pretraining (``megatron``, ``stdlib``, ``files``): positions restart at 0 after every end-of-document
    (eos) token of a packed block (Megatron's and MindFormers' option of this name)."""
    reset_attention_mask: bool = False
    """With ``reset_position_ids``: tokens attend only within their document. The boundaries reach attention as the
    restarting positions and run block-sparse; no (S, S) mask is built."""
    eod_mask_loss: bool = False
    """Causal LM pretraining: no loss on the token predicted at an end-of-document token (Megatron's option)."""
    packing: bool = False
    """``objective: instructions``: pack the prompt/response samples into rows of up to ``block_size`` tokens by
    first-fit decreasing, each sample attending only to itself (positions restart per sample) and scored on its
    response; False pads each batch to its longest sample."""
    train_files: list[str] | str | None = None
    """Training files or glob(s) when ``source: files`` (text, json/jsonl or csv); the training image folder when
    ``source: imagefolder``."""
    validation_files: list[str] | str | None = None
    """Validation files or glob(s) when ``source: files`` (the validation image folder for ``imagefolder``); None
    holds out nothing."""
    format: str | None = None
    """Loader for ``files``: text, json or csv; None infers it from the extension."""
    text_column: str = "text"
    """Column holding the text in json/csv files."""
    text_pair_column: str | None = None
    """Column holding a second text of each row (sentence-pair classification); None for single texts."""
    label_column: str = "label"
    """Column holding each row's label (classification tasks): a class name, a class id or a number."""
    block_size: int = 256
    """Tokens per training sample: language modelling concatenates documents and cuts them into blocks of this
    size; classification truncates each row to it."""
    max_files: int | None = None
    """Use at most this many stdlib files per split (quick runs); None uses all."""
    max_eval_samples: int | None = None
    """Evaluate on at most this many validation blocks; None uses all."""
    max_train_samples: int | None = None
    """Train on at most this many samples (the first ones; transformers' examples' name), for quick runs; None uses
    all."""
    image_column: str = "image"
    """Column holding the image (image classification)."""
    augment: bool = False
    """Augment the training images with a random rotation, shift and zoom (image classification), seeded per image
    and epoch, so every layout sees the same images."""
    augment_seed: int = 0
    """Seed of the augmentation."""
    objective: str | None = None
    """What a seq2seq recipe learns from its data: ``span_corruption`` (T5's pretraining objective on the text of
    ``source``, ``block_size`` tokens of text per sample), ``docstrings`` (``source: stdlib``: each documented
    function's source -> the first line of its docstring) or ``pairs`` (``source: files``: ``text_column`` ->
    ``target_column``). A causal LM recipe: None (packed text) or ``instructions`` (prompt -> response pairs scored
    on the response: ``source: stdlib`` asks for each documented function from its docstring's summary line,
    ``source: files`` reads ``text_column`` -> ``target_column``). None for the other tasks, which have one way
    each."""
    target_column: str = "target"
    """Column holding each row's target text (``objective: pairs``) or response (``objective: instructions``)."""
    source_prefix: str = ""
    """Text put before every source of a seq2seq recipe (T5's task prefixes, e.g. ``"summarize: "``); also recorded
    in the model's ``task_specific_params`` so the task's pipeline adds it too."""
    max_target_length: int = 64
    """Target tokens kept per row of a seq2seq recipe (eos included); sources keep ``block_size``."""
    noise_density: float = 0.15
    """Span corruption: share of the tokens masked."""
    mean_noise_span_length: float = 3.0
    """Span corruption: mean length of a masked span."""
    seed: int = 42
    """Seed of the data's own randomness: span corruption masks sample i by (seed, i) alone, in every layout."""

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, DATA_SOURCES)
        if self.source in ("files", "imagefolder") and not self.train_files:
            raise ConfigError(f"data.train_files is required when data.source is {self.source!r}")
        self._check_megatron_fields()
        if self.objective is not None:
            check_choice("data.objective", self.objective, OBJECTIVES)
            needed = {"docstrings": "stdlib", "pairs": "files"}.get(self.objective)
            if needed is not None and self.source != needed:
                raise ConfigError(f"data.objective={self.objective!r} needs data.source={needed!r}, got {self.source!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"data.block_size={self.block_size!r} must be an integer >= 2")


    def _check_megatron_fields(self) -> None:
        """The fields of pretokenised data, document masks and packing, checked against the source and objective."""
        if self.source == "megatron" and not self.data_path:
            raise ConfigError("data.data_path is required when data.source is 'megatron': [prefix] or [weight, prefix, "
                              "weight, prefix, ...]")
        if self.source != "megatron" and self.data_path is not None:
            raise ConfigError(f"data.data_path is only valid with data.source='megatron', got source={self.source!r}")
        if self.source == "megatron" and self.objective is not None:
            raise ConfigError(f"data.objective={self.objective!r} is not valid with data.source='megatron' (pretokenised "
                              "causal LM pretraining); leave it out")
        if self.train_weights is not None:
            entries = self.train_files if isinstance(self.train_files, list) else [self.train_files]
            if self.source != "files" or len(self.train_weights) != len(entries):
                raise ConfigError(f"data.train_weights={self.train_weights!r} needs data.source='files' and one weight "
                                  f"per data.train_files entry ({len(entries)})")
        if self.packing and self.objective != "instructions":
            raise ConfigError(f"data.packing=true packs instruction samples (data.objective='instructions'), got "
                              f"objective={self.objective!r}; pretraining text is packed into blocks already")
        resets = [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, n)]
        if resets and (self.source not in ("megatron", "stdlib", "files") or self.objective is not None):
            raise ConfigError(f"data.{resets[0]}=true applies to causal LM pretraining on packed text (source megatron, "
                              f"stdlib or files without an objective), got source={self.source!r}, "
                              f"objective={self.objective!r}")
        if self.reset_attention_mask and not self.reset_position_ids:
            raise ConfigError("data.reset_attention_mask=true needs data.reset_position_ids=true: document boundaries "
                              "reach attention as restarting position ids")
        if self.train_samples is not None and (not isinstance(self.train_samples, int) or self.train_samples < 1):
            raise ConfigError(f"data.train_samples={self.train_samples!r} must be a positive integer")


@dataclass
class GenerateSection:
    """What the task's pipeline runs on after training (``train``/``finetune``) or in ``predict``: prompts continued
    by ``pipeline("text-generation")``, texts labelled by ``pipeline("text-classification")``, ... The sampling
    fields apply to text generation."""

    prompts: list[str] = field(default_factory=list)
    """Inputs of the task's pipeline (prompts to continue, texts to classify); empty runs nothing."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    do_sample: bool = False
    """Sample (with temperature/top_k/top_p) instead of greedy decoding."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = 50
    """Sample among the k most likely tokens."""
    top_p: float = 1.0
    """Sample among the most likely tokens of this total probability."""
    repetition_penalty: float = 1.0
    """Penalty (>1) on tokens already generated."""
    num_beams: int = 1
    """Beam search width (text-to-text pipelines)."""
    pipeline: str | None = None
    """The pipeline to run (e.g. ``summarization`` for a seq2seq recipe); None: the task's own."""


def section_from_dict(cls: type, data: Mapping[str, Any] | None, name: str):
    """Build a section dataclass, refusing unknown keys with the list of valid ones."""
    data = dict(data or {})
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise ConfigError(f"{name}.{key} is not a valid key; valid keys: {', '.join(valid)}")
    return cls(**coerce_fields(cls, data, prefix=f"{name}."))
