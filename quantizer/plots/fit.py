"""Memory per rank as stacked bars: the weights by tensor class, then every other term of the fit
(KV pool, SWA rings, prefill, runtime, OS, guard or reserve, Engram cache) and what is left free.

A rank that does not fit stacks past its visible memory (the black tick) by what it lacks. One
panel per FitReport; a grid of them compares recipes (rows) on 1, 2 and 4 Sparks (columns).
"""

from __future__ import annotations

from pathlib import Path

from quantizer.fit.memory import FitReport, RankMemory
from quantizer.plots import new_figure

OWN_SEGMENT_GIB = 0.5  # a weight class this large on some rank gets its own segment; smaller ones are "other"
OTHER_WEIGHTS = "other weights"
# (label, RankMemory field) of the terms after the weights, bottom to top; free goes last.
TERMS = (("KV pool", "kv_pool_gib"), ("SWA rings", "swa_rings_gib"), ("prefill", "prefill_gib"),
         ("runtime", "runtime_gib"), ("OS", "os_gib"), ("guard", "guard_gib"),
         ("Engram cache", "engram_cache_gib"))
FREE = "free"
TERM_COLORS = {"KV pool": "#e6550d", "SWA rings": "#fd8d3c", "prefill": "#fdae6b", "runtime": "#756bb1",
               "OS": "#636363", "guard": "#969696", "Engram cache": "#c994c7", FREE: "#c7e9c0"}
WEIGHT_COLORS = ("#08519c", "#3182bd", "#6baed6", "#9ecae1", "#31a354", "#74c476", "#a1d99b", "#8c6d31",
                 "#bd9e39", "#e7ba52", "#c6dbef")
PANEL_IN = (3.6, 3.4)


def weight_classes(reports: list[FitReport]) -> list[str]:
    """Classes that get a segment of their own, largest first, across all panels (one legend)."""
    peak: dict[str, float] = {}
    for r in reports:
        for m in r.ranks:
            for c, g in m.weights_by_class_gib.items():
                peak[c] = max(peak.get(c, 0.0), g)
    return sorted((c for c, g in peak.items() if g >= OWN_SEGMENT_GIB), key=lambda c: -peak[c])


def segments(m: RankMemory, classes: list[str]) -> dict[str, float]:
    """GiB of each bar segment of one rank, bottom to top; they add up to the visible memory when
    the rank fits (free >= 0), and past it by the shortfall when it does not (free is then 0)."""
    own = {f"weights: {c}": m.weights_by_class_gib.get(c, 0.0) for c in classes}
    other = sum(g for c, g in m.weights_by_class_gib.items() if c not in classes)
    out = {**own, OTHER_WEIGHTS: other}
    out.update({label: getattr(m, name) for label, name in TERMS})
    out[FREE] = max(m.free_gib, 0.0)
    return out


def fit_figure(grid: list[list[FitReport]], row_labels: list[str] | None = None):
    """Stacked bars per rank for every report of `grid` (rows x columns); segments that are zero on
    every rank of every panel are left out, so each panel has (segments x ranks) bars."""
    flat = [r for row in grid for r in row]
    classes = weight_classes(flat)
    per = {id(r): [segments(m, classes) for m in r.ranks] for r in flat}
    names = [n for n in per[id(flat[0])][0] if any(s[n] > 0 for segs in per.values() for s in segs)]
    colors = dict(zip([n for n in names if n.startswith("weights")] + [OTHER_WEIGHTS], WEIGHT_COLORS))
    colors.update(TERM_COLORS)
    rows, cols = len(grid), max(len(row) for row in grid)
    fig = new_figure(PANEL_IN[0] * cols + 1.8, PANEL_IN[1] * rows + 0.3)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    for i, row in enumerate(grid):
        for j in range(cols):
            ax = axes[i][j]
            if j >= len(row):
                ax.set_axis_off()
                continue
            _panel(ax, row[j], per[id(row[j])], names, colors)
            if j == 0:
                label = row_labels[i] if row_labels else _source(row[j])
                ax.set_ylabel(f"{label}\nGiB per rank")
    top = max(max(sum(s.values()), m.visible_gib) for r in flat for s, m in zip(per[id(r)], r.ranks))
    axes[0][0].set_ylim(0, top * 1.12)  # headroom for the "short" notes; the y axis is shared
    handles = list(axes[0][0].containers)
    fig.legend(handles, names, loc="outside right center", fontsize=8, frameon=False)
    return fig


def _panel(ax, r: FitReport, segs: list[dict[str, float]], names: list[str], colors: dict[str, str]) -> None:
    ranks = [m.rank for m in r.ranks]
    bottom = [0.0] * len(ranks)
    for n in names:
        heights = [s[n] for s in segs]
        ax.bar(ranks, heights, bottom=bottom, color=colors[n], width=0.7, label=n,
               edgecolor="#2ca25f" if n == FREE else "none", linewidth=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for m, top in zip(r.ranks, bottom):
        ax.hlines(m.visible_gib, m.rank - 0.42, m.rank + 0.42, colors="black", linewidth=1.5)
        if m.free_gib < 0:
            ax.annotate(f"short\n{-m.free_gib:,.1f}", (m.rank, top), ha="center", va="bottom", fontsize=7,
                        color="#a50f15")
    ax.set_xticks(ranks, [f"rank {k}" for k in ranks], fontsize=8)
    ax.set_xlim(-0.6, max(len(ranks), 2) - 0.4)
    ax.set_title(f"{r.sparks} Spark{'s' if r.sparks > 1 else ''} at {_tokens(r.context)} x {r.streams}: "
                 f"{'fits' if r.fits else 'does not fit'}\n{_largest(r)}", fontsize=8)
    ax.grid(axis="y", linewidth=0.3)


def _largest(r: FitReport) -> str:
    if r.max_context <= 0:
        return "no context fits"
    cap = " (the model's limit)" if r.max_context_capped else ""
    return f"largest context {r.max_context:,} tokens{cap}"


def _tokens(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _source(r: FitReport) -> str:
    return Path(r.source).name if r.source else r.arch
