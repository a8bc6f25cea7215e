"""The tutorial notebook (`examples/learned_locality.ipynb`) runs top to bottom on the CPU, its own asserts
included (tiered tokens equal to the all-resident ones), and is committed without outputs."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "examples", "learned_locality.ipynb")

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the test extras (nbformat, nbclient)")


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow  # CI: on the lowest-jax leg, the shorter one (it passes on jax 0.12 too)
def test_notebook_runs_top_to_bottom():
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": ROOT}})
    client.execute()  # raises CellExecutionError (with the cell and its traceback) if any cell fails
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "hit rate" in text and "HiSparse" in text
