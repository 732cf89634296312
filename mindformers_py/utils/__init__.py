"""Small shared utilities (checkpoint file I/O, atomic folder writes)."""
