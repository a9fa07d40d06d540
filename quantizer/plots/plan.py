"""K per layer and projection as a heatmap, one panel per plan, on one colour scale so plans of the
same model compare cell by cell (ours against exllamav3's allocator at one size, say).

Rows are the budgeted projections of the trunk (routed and shared experts, attention, indexer,
Engram); columns are layers. A routed cell is the mean K over the layer's experts (one K under a
loader that keeps one K per projection; a mean where experts differ). Blank cells: the layer has no
such projection, or keeps it native.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.plan import Plan
from quantizer.model.targets import targets
from quantizer.plots import new_figure

LABEL_CELLS_UP_TO = 64  # layers; wider grids are too narrow to print K in each cell
K_RANGE = (1.0, 8.0)  # exllamav3's trellis K; fp16 linears (K 16) show in the colour beyond the top


def k_grid(cfg: ModelConfig, plan: Plan) -> tuple[list[str], list[int], list[list[float]]]:
    """(row labels "group proj", layers, K[row][layer] with NaN where there is nothing to show)."""
    ks: dict[tuple[str, int], list[float]] = defaultdict(list)
    rows: list[str] = []
    for t in targets(cfg):
        if not t.budgeted or t.layer is None:
            continue
        row = f"{t.group} {t.proj}"
        if row not in rows:
            rows.append(row)
        k = plan.k[t.key]
        if k is not None:
            ks[row, t.layer].append(k)
    layers = sorted({layer for _, layer in ks})
    grid = [[sum(v) / len(v) if (v := ks.get((row, layer))) else math.nan for layer in layers] for row in rows]
    return rows, layers, grid


def k_figure(cfg: ModelConfig, plans: list[Plan]):
    """One heatmap per plan, stacked, with one colour bar; each panel is titled by who made the plan."""
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(over="#d62728", bad="#f0f0f0")
    first = k_grid(cfg, plans[0])
    width = max(6.0, 0.22 * len(first[1]) + 3.5)
    fig = new_figure(width, 0.25 * len(first[0]) * len(plans) + 1.1 * len(plans) + 0.4)
    axes = fig.subplots(len(plans), 1, squeeze=False)[:, 0]
    image = None
    for ax, plan in zip(axes, plans):
        rows, layers, grid = k_grid(cfg, plan)
        image = ax.imshow(grid, cmap=cmap, vmin=K_RANGE[0], vmax=K_RANGE[1], aspect="auto", interpolation="none")
        _label_cells(ax, grid)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        step = max(1, len(layers) // 20)
        ax.set_xticks(range(0, len(layers), step), [str(layers[i]) for i in range(0, len(layers), step)], fontsize=7)
        ax.set_xlabel("layer", fontsize=8)
        mean = "; cells of experts with different K show their mean" if _experts_differ(cfg, plan) else ""
        ax.set_title(textwrap.fill(f"{plan.made_by}", 150) +
                     f"\n{plan.achieved_bpw:.4f} bpw, loader {plan.profile.name}{mean}", fontsize=7)
    bar = fig.colorbar(image, ax=list(axes), extend="max", shrink=0.9)
    bar.set_label("K (bits per weight)", fontsize=8)
    return fig


def _experts_differ(cfg: ModelConfig, plan: Plan) -> bool:
    seen: dict[tuple, set] = defaultdict(set)
    for t in targets(cfg):
        if t.expert is not None:
            seen[t.group, t.layer, t.proj].add(plan.k[t.key])
    return any(len(ks) > 1 for ks in seen.values())


def _label_cells(ax, grid: list[list[float]]) -> None:
    """K printed in every cell (dark text on the light end of the scale)."""
    if len(grid[0]) > LABEL_CELLS_UP_TO:
        return
    for i, row in enumerate(grid):
        for j, k in enumerate(row):
            if not math.isnan(k):
                ax.text(j, i, f"{k:.3g}", ha="center", va="center", fontsize=5.5,
                        color="black" if k >= 5.5 else "white")
