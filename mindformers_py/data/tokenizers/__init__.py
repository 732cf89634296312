"""Tokenizers trained locally with the ``tokenizers`` library, so nothing is downloaded: :mod:`.bpe_wordpiece`
(byte-level BPE, GPT-2's recipe, and WordPiece, BERT's) and :mod:`.t5` (byte-level BPE with T5's special tokens and
sentinels)."""
