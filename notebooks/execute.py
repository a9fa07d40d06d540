"""Run a notebook top to bottom with nbclient, as CI does (tests/test_notebook.py), and with
`--in-place` save it with its outputs, so a reader sees the figures without running it:

    python notebooks/execute.py notebooks/first_look.ipynb --in-place

The kernel is the running Python's (`python3`), started in the notebook's folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

CELL_TIMEOUT_S = 600


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at `path` with every cell executed; raises CellExecutionError at the first
    cell that fails."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--in-place", action="store_true", help="save the outputs into the notebook")
    args = p.parse_args()
    nb = execute(args.notebook)
    if args.in_place:
        tmp = args.notebook.with_name(args.notebook.name + ".tmp")
        nbformat.write(nb, tmp)
        tmp.replace(args.notebook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
