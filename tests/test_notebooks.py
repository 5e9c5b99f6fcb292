"""Every notebook executes top to bottom without error (and shows what its prose promises)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
EXPECTED = {  # text each notebook must print
    "row_sparse.ipynb": ["RowSparseArray(float32[5, 2], rows=2)", "strict:", "RowSparseArray [0, 3]"],
    "masked_adagrad.ipynb": ["same as by hand: True", "bcoo, jit: True", "x faster"],
    "jacobian_check.ipynb": ["('masked',)", "('dense',)", "fix passes: ('dense', 'masked')", "<-- mismatch",
                             "forward mode skipped", "fast: True passed: True", "4.", "31."],
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    text = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    for needle in EXPECTED.get(path.name, []):
        assert needle in text, f"{path.name} should print {needle!r}"


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ is empty"
