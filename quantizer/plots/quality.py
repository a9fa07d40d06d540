"""Quality against bits from `quantizer demo --json` rows: KL(native || pack) and top-1 agreement
against the bits each pack achieved, one curve per method with +-1 standard error bars. Methods
(and the loader profiles a method was planned for, where it has several) come from the rows, in
the order they first appear."""

from __future__ import annotations

from quantizer.errors import UserError
from quantizer.plots import new_figure

NEEDED = ("method", "achieved_bpw", "kl", "kl_stderr", "top1", "top1_stderr")
MARKERS = "osD^v<>ph*"


def curves(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per curve, by label: the method, with its loader where one method has rows for several."""
    loaders: dict[str, set] = {}
    for r in rows:
        loaders.setdefault(r["method"], set()).add(r.get("loader"))
    out: dict[str, list[dict]] = {}
    for r in rows:
        label = r["method"] + (f" ({r['loader']})" if len(loaders[r["method"]]) > 1 else "")
        out.setdefault(label, []).append(r)
    return {label: sorted(mine, key=lambda r: r["achieved_bpw"]) for label, mine in out.items()}


def quality_figure(rows: list[dict]):
    """Two panels (KL, top-1) with one errorbar curve per method."""
    if not rows:
        raise UserError("no demo rows to plot")
    missing = sorted({k for r in rows for k in NEEDED if k not in r})
    if missing:
        raise UserError(f"demo rows lack {', '.join(missing)}: rows from `quantizer demo --json` of this version")
    fig = new_figure(10.0, 4.0)
    kl_ax, top_ax = fig.subplots(1, 2)
    for i, (label, mine) in enumerate(curves(rows).items()):
        bits = [r["achieved_bpw"] for r in mine]
        style = dict(marker=MARKERS[i % len(MARKERS)], capsize=3, markersize=5, linewidth=1.2, label=label)
        kl_ax.errorbar(bits, [r["kl"] for r in mine], yerr=[r["kl_stderr"] for r in mine], **style)
        top_ax.errorbar(bits, [100 * r["top1"] for r in mine], yerr=[100 * r["top1_stderr"] for r in mine], **style)
    kl_ax.set_ylabel("KL(native || pack), nats per token")
    top_ax.set_ylabel("top-1 agreement with the native model, %")
    for ax in (kl_ax, top_ax):
        ax.set_xlabel("achieved bits per weight (budgeted tensors)")
        ax.grid(linewidth=0.3)
    kl_ax.legend(fontsize=8, title="method (±1 s.e.)", title_fontsize=8)
    return fig
