"""Figures of what a pack costs: memory per rank (fit), K per layer and projection (plan) and
quality against bits (demo). The `--plot FILE` flags of those commands and notebooks/ draw them
with the same functions. matplotlib is the `plots` extra, so the core install stays lean: nothing
here imports it until a figure is asked for.

Figures are matplotlib `Figure` objects drawn on the Agg canvas (headless, no pyplot state) at a
fixed size and DPI, so a saved PNG has a known size in pixels.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from quantizer.errors import UserError

EXTRA = "pip install 'quantizer[plots]'"
DPI = 100
FORMATS = ("png", "svg", "pdf")


def require_matplotlib() -> None:
    """UserError with the extra to install when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(f"plots need matplotlib: install the plots extra ({EXTRA})")


def plot_path(path: str | os.PathLike) -> Path:
    """Check up front, before any long work, that a figure can be written to `path`."""
    require_matplotlib()
    path = Path(path)
    if path.suffix.lower().lstrip(".") not in FORMATS:
        raise UserError(f"--plot {path}: name a .png, .svg or .pdf file")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: no such directory {path.parent}")
    return path


def new_figure(width_in: float, height_in: float):
    """A Figure on the Agg canvas, laid out by matplotlib's constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Write under a temporary name, then rename: a reader never finds half a PNG."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=DPI)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
