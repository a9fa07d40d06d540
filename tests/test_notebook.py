"""notebooks/first_look.ipynb runs top to bottom on this checkout (CI's clean clone) without a
failing cell, draws its three figures, and is committed with those figures in it."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from script_module import script_module

pytestmark = pytest.mark.slow  # runs every cell of the notebook: `make test-fast` skips it

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "first_look.ipynb"
DEMO_ROWS = ROOT / "docs" / "figures" / "demo.json"
# memory per rank, K heatmap, and quality against bits once `make figures` has committed the demo rows
FIGURES = 3 if DEMO_ROWS.exists() else 2


def _execute():
    with script_module(ROOT / "notebooks" / "execute.py") as module:
        return module.execute


def _images(nb) -> list[str]:
    return [out["data"]["image/png"] for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def _errors(nb) -> list[str]:
    return [f"{out['ename']}: {out['evalue']}" for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def test_notebook_executes_every_cell_and_draws_its_figures():
    from nbclient.exceptions import CellExecutionError

    try:
        nb = _execute()(NOTEBOOK)
    except CellExecutionError as e:
        pytest.fail(f"a notebook cell failed:\n{str(e)[-3000:]}")
    assert not _errors(nb)
    assert len(_images(nb)) == FIGURES


def test_committed_notebook_carries_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "run `python notebooks/execute.py notebooks/first_look.ipynb --in-place`"
    assert not _errors(nb) and len(_images(nb)) == FIGURES
