"""Data: the embedded default corpus (Python stdlib source), tokenizer training (:mod:`.tokenizers`: BPE, WordPiece,
T5's), packing, masked-LM blocks and per-sample masking, collators, the stdlib datasets (:mod:`.stdlib`), packed
fine-tuning; Megatron's corpus formats in :mod:`.megatron` (indexed datasets, reading and writing,
``data.megatron.preprocess`` tokenising into them, its GPT samples and blends, weighted mixtures)."""

from ..utils.lazy_exports import lazy_exports as _lazy_exports

_EXPORTS = {
    "default_cache_dir": ".cache",
    **dict.fromkeys(["DataCollatorForCausalLM", "StackingCausalLMCollator"], ".collators"),
    **dict.fromkeys(["load_text_files", "split_of", "stdlib_corpus", "stdlib_files", "stdlib_root"], ".corpus"),
    **dict.fromkeys(["count_tokens", "pack_dataset"], ".packing"),
    **dict.fromkeys(["default_pretraining_data", "tokenizer_fingerprint"], ".pretraining"),
    **dict.fromkeys(["DEFAULT_VOCAB_SIZE", "ENDOFTEXT", "PAD", "default_tokenizer", "default_tokenizer_path",
                     "default_wordpiece_tokenizer", "train_bpe_tokenizer", "train_wordpiece_tokenizer"],
                    ".tokenizers.bpe_wordpiece"),
    "DataCollatorForMaskedLM": ".masking",
    **dict.fromkeys(["default_masked_lm_data", "masked_lm_blocks"], ".masked_lm"),
    "stdlib_docstrings": ".stdlib.docstrings",
    **dict.fromkeys(["IndexedDataset", "IndexedDatasetWriter"], ".megatron.indexed_dataset"),
    **dict.fromkeys(["GPTSampleOptions", "MegatronGPTDataset"], ".megatron.gpt_dataset"),
    **dict.fromkeys(["BlendedDataset", "build_megatron_datasets", "mix_datasets"], ".megatron.blending"),
    **dict.fromkeys(["PackedRowsCollator", "first_fit_decreasing", "pack_samples"], ".sft_packing"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
