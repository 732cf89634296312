"""Labelled datasets on every machine, made from the running interpreter's standard library source (the default
corpus, :mod:`mindformers_py.data.corpus`) for the recipes that need no download: :mod:`.docstrings` (which package
a docstring comes from: text classification), :mod:`.code_summaries` (a function's source and its docstring's first
line: summarisation) and :mod:`.instructions` (prompt and response pairs for causal-LM fine-tuning, with their
tokenization)."""
