"""Extractive question answering: transformers 4's ``question-answering`` pipeline, which transformers 5 removed.

Same inputs (``pipe(question=..., context=...)``, a ``{"question", "context"}`` dict, lists of either, or two
strings), same arguments (``top_k``, ``max_answer_len``, ``max_seq_len``, ``doc_stride``, ``max_question_len``,
``handle_impossible_answer``, ``align_to_words``, ``padding``) and the same output: ``{"score", "start", "end",
"answer"}`` (one dict, or a list of ``top_k`` dicts), with character offsets into the context. The behaviour
reproduced, step by step:

1. The question and context are tokenised as a pair (question first when the tokenizer pads on the right), the
   context cut into windows of at most ``max_seq_len`` tokens (default ``min(model_max_length, 384)``) that
   overlap by ``doc_stride`` tokens (default ``min(max_seq_len // 2, 128)``); each window is one model call.
2. In each window only context tokens (and the first token, [CLS]) may be scored: the others get logit -10000;
   start and end logits become probabilities by a softmax over the window.
3. With ``handle_impossible_answer``, the smallest P(start=[CLS]) x P(end=[CLS]) over the windows is the score of
   the empty answer. [CLS] is then excluded (probability 0).
4. A span's score is P(start) x P(end) for start <= end < start + ``max_answer_len``; the best
   ``2 * top_k + 10`` spans (``top_k`` without ``align_to_words``) whose ends are both context tokens are kept.
5. Spans become character ranges, widened to whole words with ``align_to_words``; spans giving the same text
   (ignoring case) in several windows add up their scores. The ``top_k`` best are returned.

Only fast tokenizers (every tokenizer of transformers 5) are supported; ``max_question_len`` applies to the slow
ones only, as in transformers 4, and is accepted for compatibility.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import numpy as np
import torch
from transformers.pipelines.base import ChunkPipeline

from ..errors import ConfigError, MindFormersError
from .base import AcceptsOurModels

NEUTRALISED_LOGIT = -10000.0
"""The logit given to tokens that cannot be part of an answer, before the softmax."""


class QuestionAnsweringPipeline(AcceptsOurModels, ChunkPipeline):
    """transformers 4's ``QuestionAnsweringPipeline`` (see the module docstring) on any extractive QA model
    (ours or transformers')."""

    default_input_names = "question,context"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from transformers.models.auto.modeling_auto import MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES

        self.check_model_type(MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES)

    def _sanitize_parameters(self, padding=None, topk=None, top_k=None, doc_stride=None, max_answer_len=None,
                             max_seq_len=None, max_question_len=None, handle_impossible_answer=None,
                             align_to_words=None, **kwargs):
        pre: dict[str, Any] = {k: v for k, v in (("padding", padding), ("doc_stride", doc_stride),
                                                 ("max_seq_len", max_seq_len), ("max_question_len", max_question_len))
                               if v is not None}
        post: dict[str, Any] = {}
        top_k = top_k if top_k is not None else topk
        if top_k is not None:
            if top_k < 1:
                raise ConfigError(f"top_k={top_k} is not valid; use an integer >= 1")
            post["top_k"] = top_k
        if max_answer_len is not None:
            if max_answer_len < 1:
                raise ConfigError(f"max_answer_len={max_answer_len} is not valid; use an integer >= 1")
            post["max_answer_len"] = max_answer_len
        if handle_impossible_answer is not None:
            post["handle_impossible_answer"] = handle_impossible_answer
        if align_to_words is not None:
            post["align_to_words"] = align_to_words
        return pre, {}, post

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Answer ``question`` from ``context``: keyword arguments (strings or equal-length lists; one context for
        several questions too), a ``{"question", "context"}`` dict or a list of them, or two strings."""
        examples = _examples(args, kwargs)
        if len(examples) == 1:
            return super().__call__(examples[0], **kwargs)
        return super().__call__(examples, **kwargs)

    # -- the three pipeline steps -------------------------------------------------------------------------------

    def preprocess(self, example: dict[str, str], padding: str = "do_not_pad", doc_stride: int | None = None,
                   max_question_len: int = 64, max_seq_len: int | None = None):
        example = _checked(example)
        if not getattr(self.tokenizer, "is_fast", False):
            raise MindFormersError("the question-answering pipeline needs a fast tokenizer (one with offset mappings)")
        if max_seq_len is None:
            max_seq_len = min(self.tokenizer.model_max_length, 384)
        if doc_stride is None:
            doc_stride = min(max_seq_len // 2, 128)
        if doc_stride > max_seq_len:
            raise ConfigError(f"doc_stride={doc_stride} is larger than max_seq_len={max_seq_len}; lower doc_stride")
        question_first = self.tokenizer.padding_side == "right"
        first, second = (example["question"], example["context"]) if question_first else (example["context"], example["question"])
        encoded = self.tokenizer(text=first, text_pair=second, padding=padding,
                                 truncation="only_second" if question_first else "only_first", max_length=max_seq_len,
                                 stride=doc_stride, return_token_type_ids=True, return_overflowing_tokens=True,
                                 return_offsets_mapping=True, return_special_tokens_mask=True)
        windows = len(encoded["input_ids"])
        context_id = 1 if question_first else 0
        for w in range(windows):
            ids = encoded["input_ids"][w]
            # 1 where a token cannot be in the answer: everything but the context, [CLS] excepted
            p_mask = [int(seq != context_id) for seq in encoded.sequence_ids(w)]
            if self.tokenizer.cls_token_id is not None:
                for i, token in enumerate(ids):
                    if token == self.tokenizer.cls_token_id:
                        p_mask[i] = 0
            model_inputs = {name: torch.tensor([encoded[name][w]]) for name in self.tokenizer.model_input_names
                            if name in encoded}
            if "token_type_ids" in encoded:
                model_inputs["token_type_ids"] = torch.tensor([encoded["token_type_ids"][w]])
            yield {"example": example, "is_last": w == windows - 1, "p_mask": torch.tensor([p_mask]),
                   "encoding": encoded[w], **model_inputs}

    def _forward(self, inputs: dict[str, Any]) -> dict[str, Any]:
        names = [n for n in self.tokenizer.model_input_names if n in inputs]
        model_inputs = {n: inputs[n] for n in names}
        if "use_cache" in inspect.signature(self.model.forward).parameters:
            model_inputs["use_cache"] = False
        output = self.model(**model_inputs)
        start, end = (output["start_logits"], output["end_logits"]) if isinstance(output, dict) else output[:2]
        return {**inputs, "start": start, "end": end}

    def postprocess(self, model_outputs: list[dict[str, Any]], top_k: int = 1, handle_impossible_answer: bool = False,
                    max_answer_len: int = 15, align_to_words: bool = True) -> dict[str, Any] | list[dict[str, Any]]:
        null_score = 1000000.0  # the empty answer's score: the smallest over the windows
        answers: list[dict[str, Any]] = []
        candidates_wanted = top_k * 2 + 10 if align_to_words else top_k  # word alignment may merge some
        question_first = self.tokenizer.padding_side == "right"
        for output in model_outputs:
            start, end = (output[k].float() if output[k].dtype == torch.bfloat16 else output[k] for k in ("start", "end"))
            attention = output.get("attention_mask")
            allowed = 1 - np.asarray(output["p_mask"])
            if attention is not None:
                allowed = allowed & attention.numpy()
            start_p, end_p = _window_probabilities(start, allowed), _window_probabilities(end, allowed)
            if handle_impossible_answer:
                null_score = min(null_score, (start_p[0, 0] * end_p[0, 0]).item())
            start_p[0, 0] = end_p[0, 0] = 0.0
            example, encoding = output["example"], output["encoding"]
            shift = int((output["input_ids"] == self.tokenizer.pad_token_id).sum()) \
                if self.tokenizer.padding_side == "left" else 0
            for s, e, score in zip(*_best_spans(start_p, end_p, allowed, candidates_wanted, max_answer_len)):
                first, last = _char_range(encoding, int(s) - shift, int(e) - shift, 1 if question_first else 0,
                                          align_to_words)
                text = example["context"][first:last]
                same = next((a for a in answers if a["answer"].lower() == text.lower()), None)
                if same is not None:
                    same["score"] += score.item()
                else:
                    answers.append({"score": score.item(), "start": first, "end": last, "answer": text})
        if handle_impossible_answer:
            answers.append({"score": null_score, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda a: a["score"], reverse=True)[:top_k]
        return answers[0] if len(answers) == 1 else answers


def _examples(args: tuple, kwargs: dict[str, Any]) -> list[dict[str, str]]:
    """The call's inputs as a list of ``{"question", "context"}`` dicts, checked (one-line errors)."""
    if len(args) == 2 and all(isinstance(a, str) for a in args):
        items: Any = [{"question": args[0], "context": args[1]}]
    elif len(args) == 1:
        items = args[0]
    elif args:
        items = list(args)
    elif "question" in kwargs or "context" in kwargs:
        question, context = kwargs.pop("question", None), kwargs.pop("context", None)
        if isinstance(question, list) and isinstance(context, str):
            items = [{"question": q, "context": context} for q in question]
        elif isinstance(question, list) and isinstance(context, list):
            if len(question) != len(context):
                raise MindFormersError(f"question-answering got {len(question)} questions and {len(context)} contexts; "
                                       "give one context per question, or one context for all")
            items = [{"question": q, "context": c} for q, c in zip(question, context)]
        else:
            items = [{"question": question, "context": context}]
    else:
        raise MindFormersError("question-answering needs a question and a context: pipe(question=..., context=...)")
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, Iterable) or isinstance(items, str):
        raise MindFormersError(f"question-answering inputs must be question/context dicts, got {type(items).__name__}")
    return [_checked(item) for item in items]


def _checked(item: Any) -> dict[str, str]:
    if not isinstance(item, dict):
        raise MindFormersError(f"question-answering inputs must be {{'question': ..., 'context': ...}} dicts, got "
                               f"{type(item).__name__}")
    for key in ("question", "context"):
        value = item.get(key)
        if not isinstance(value, str) or not value.strip():
            other = "context" if key == "question" else "question"
            raise MindFormersError(f"question-answering needs a non-empty {key} (got {value!r}) with the {other}: "
                                   f"pipe(question=..., context=...)")
    return item


def _window_probabilities(logits: torch.Tensor, allowed: np.ndarray) -> np.ndarray:
    """Softmax over one window (1, T) after giving the tokens that cannot answer a logit of -10000."""
    scores = np.where(allowed == 0, NEUTRALISED_LOGIT, logits)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return scores / scores.sum()


def _best_spans(start: np.ndarray, end: np.ndarray, allowed: np.ndarray, wanted: int, max_answer_len: int):
    """(starts, ends, scores) of the ``wanted`` best spans with ``start <= end < start + max_answer_len`` whose
    ends both lie on answer tokens, best first. (As in transformers 4, position 0 always counts as such a token.)"""
    scores = np.tril(np.triu(start[0][:, None] * end[0][None, :]), max_answer_len - 1)  # (T, T)
    flat = scores.flatten()
    if wanted == 1:
        order = [np.argmax(flat)]
    elif len(flat) < wanted:
        order = np.argsort(-flat)
    else:
        top = np.argpartition(-flat, wanted)[:wanted]
        order = top[np.argsort(-flat[top])]
    starts, ends = np.unravel_index(order, scores.shape)
    answer_tokens = np.union1d(np.flatnonzero(allowed[0]), [0]) if allowed.any() else np.array([], dtype=int)
    keep = np.isin(starts, answer_tokens) & np.isin(ends, answer_tokens)
    starts, ends = starts[keep], ends[keep]
    return starts, ends, scores[starts, ends]


def _char_range(encoding: Any, first: int, last: int, sequence: int, align_to_words: bool) -> tuple[int, int]:
    """Character range of tokens ``first..last`` in the context, widened to whole words with ``align_to_words``
    (tokens outside any word, such as [CLS], keep their own offsets)."""
    if align_to_words:
        try:
            start_word, end_word = encoding.token_to_word(first), encoding.token_to_word(last)
            return (encoding.word_to_chars(start_word, sequence_index=sequence)[0],
                    encoding.word_to_chars(end_word, sequence_index=sequence)[1])
        except Exception:  # noqa: BLE001 - tokens without a word (special tokens) have no word range
            pass
    return encoding.offsets[first][0], encoding.offsets[last][1]
