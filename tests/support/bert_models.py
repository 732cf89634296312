"""Tiny random HF BERT and RoBERTa reference models and a WordPiece tokenizer (built locally, no hub)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
HEADS = {
    "base": transformers.AutoModel,
    "masked_lm": transformers.AutoModelForMaskedLM,
    "sequence_classification": transformers.AutoModelForSequenceClassification,
    "token_classification": transformers.AutoModelForTokenClassification,
    "question_answering": transformers.AutoModelForQuestionAnswering,
    "pretraining": transformers.AutoModelForPreTraining,
}


def tiny_bert_config(kind: str = "bert", **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=64, type_vocab_size=2, pad_token_id=0, **common)
    elif kind == "roberta":
        config = transformers.RobertaConfig(max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                            eos_token_id=2, layer_norm_eps=1e-5, **common)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_bert_model(kind: str = "bert", head: str = "base", **overrides):
    """A seeded tiny HF model with non-trivial weights (biases and norms randomised too, so a mapping mistake shows)."""
    torch.manual_seed(1234)
    model = HEADS[head].from_config(tiny_bert_config(kind, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def padded_batch(kind: str = "bert", lengths=(16, 11, 5), pairs: bool = True, seed: int = 0):
    """Right-padded rows of random ids (no special ids inside) with an attention mask and, for BERT, segment ids
    (the second half of each row is segment B)."""
    g = torch.Generator().manual_seed(seed)
    pad = 0 if kind == "bert" else 1
    length = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), length), generator=g)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "bert" and pairs:
        batch["token_type_ids"] = ((torch.arange(length)[None] >= torch.tensor(lengths)[:, None] // 2) & (mask == 1)).long()
    return batch


def wordpiece_tokenizer(folder) -> transformers.PreTrainedTokenizerFast:
    """A BERT-style (uncased WordPiece) fast tokenizer with a small vocabulary, saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = ("the a an is was of to in and or on at by for with from paris france capital city river seine "
             "london england berlin germany rome italy population million people lives live located largest "
             "what where who which how many when def return class import print value list dict code python "
             "function module package test data model train").split()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = ["##s", "##ed", "##ing", "##er", "##ly"] + list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'()-")
    pieces += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(special + words + pieces))}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
        mask_token="[MASK]", model_max_length=64)
    tokenizer.save_pretrained(str(folder))
    return tokenizer
