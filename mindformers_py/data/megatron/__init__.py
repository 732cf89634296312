"""Megatron's corpus formats, read and written as Megatron-LM and Megatron-Core do: :mod:`.indexed_dataset`
(``<prefix>.bin`` / ``<prefix>.idx``), :mod:`.preprocess` (``mindformers-py preprocess``: text into them),
:mod:`.gpt_dataset` (GPT training samples drawn from them, as ``GPTDataset``) and :mod:`.blending` (weighted
mixtures, as ``BlendedDataset``, and the same blending for ``datasets`` tables)."""
