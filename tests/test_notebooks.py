"""Every notebook runs top to bottom (small settings) in a fresh kernel: its headline figure, its two-process cell
(the one flag: the Trainer starts its workers from the kernel and the loss curve matches one process's), and outputs
a reader can use (progress bars as widgets, not hundreds of stored text updates; metrics as plain numbers)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints once it has run to its end (its headline figure).
MAX_OUTPUTS_PER_CELL = 20  # a widget bar is one output; a text bar stored every update was ~210
RESULT_LINES = {"finetune_gpt.ipynb": "validation perplexity", "finetune_vit_digits.ipynb": "held-out accuracy",
                "finetune_bert_classification.ipynb": "validation accuracy"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MINDFORMERS_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MINDFORMERS_PY_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(path, as_version=4)
    # Run from a scratch copy of the notebooks folder so ../runs lands in tmp_path, not in the repository.
    workdir = tmp_path / "notebooks"
    workdir.mkdir()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    result = RESULT_LINES.get(path.name, "validation perplexity")
    assert any(o.get("text", "").startswith(result) for c in nb.cells for o in c.get("outputs", []))
    texts = [o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells for o in c.get("outputs", [])]
    assert any("two processes:" in t and "largest relative difference" in t for t in texts)
    assert not any("np.float64(" in t or "IProgress not found" in t for t in texts)
    assert max(len(c.get("outputs", [])) for c in nb.cells) <= MAX_OUTPUTS_PER_CELL
