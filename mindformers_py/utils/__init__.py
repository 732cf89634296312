"""Small shared utilities: lazy re-exports, typed config sections and values, batch rows, one-line errors for
damaged JSON files (checkpoint files are :mod:`mindformers_py.checkpoint`'s)."""
