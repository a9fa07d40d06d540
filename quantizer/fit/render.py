"""The fit report as the per-rank table `quantizer fit`, `plan --sparks` and `build` print."""

from __future__ import annotations

from quantizer.fit.memory import FitReport
from quantizer.report import table

PLANNED = "the context this pack was planned for (its build's --context)"  # `fit PACK` and the card say it alike


def render(r: FitReport, explain: bool = False, floor: FitReport | None = None, note: str | None = None,
           full: FitReport | None = None) -> str:
    """The table and verdict; with `explain`, every term with its source, and `floor`: the same weights
    under DeepSeek's design floor (configs/hardware's `native`), a lower bound no engine reaches. `note` says
    where the context comes from (`context_note`); `full` is the same fit at the model's full context, whose
    verdict goes beside the first."""
    guard = "reserve" if any("replaces the guard" in t.name for t in r.terms) else "guard"
    headers = ["rank", "visible", "weights", "KV pool", "SWA rings", "prefill", "runtime", "OS", guard,
               "Engram cache", "free", "max context"]
    rows = [[m.rank] + [f"{v:,.2f}" for v in (
        m.visible_gib, m.weights_gib, m.kv_pool_gib, m.swa_rings_gib, m.prefill_gib, m.runtime_gib,
        m.os_gib, m.guard_gib, m.engram_cache_gib, m.free_gib)] + [f"{m.max_context:,}"] for m in r.ranks]
    if r.mapped:  # an engine that serves weights from the mapped file: the page cache it uses beside
        headers.insert(3, "mapped")
        for row, m in zip(rows, r.ranks):
            row.insert(3, f"{m.mapped_gib:,.2f}")
    lines = [
        f"{r.source}: {r.arch} on {r.sparks} Spark{'s' if r.sparks > 1 else ''}, engine {r.engine}, "
        f"split {r.split}, Engram {r.engram}, drafter {r.drafter}, vision {r.vision}; "
        f"{r.context:,} tokens x {r.streams} stream(s) at {r.kv_bytes_per_token:,.0f} B/token (GiB)",
        *([note] if note else []),
        table(headers, rows),
        "",
        *([r.findings.line()] if r.findings else []),
        ("FITS: " if r.fits else "DOES NOT FIT: ") + r.verdict,
        *([f"at the model's full context: {'FITS' if full.fits else 'DOES NOT FIT'}: {full.verdict}"] if full else []),
        *([r.decode.line()] if r.decode else []),
    ]
    if r.mapped:
        lines.insert(2 + bool(note), "weights: copied into GPU memory; mapped: served from the mapped file (page cache, "
                                     "reclaimable, read from NVMe again once dropped), not counted against free")
    if explain:
        classes = sorted({c for m in r.ranks for c in m.weights_by_class_gib})
        lines += ["", "weights by class (GiB):",
                  table(["class"] + [f"rank {m.rank}" for m in r.ranks],
                        [[c] + [f"{m.weights_by_class_gib.get(c, 0.0):,.3f}" for m in r.ranks] for c in classes])]
        lines += ["", "terms:"] + [f"  {t.name}: {t.value}\n      source: {t.source}" for t in r.terms]
        if floor:
            worst = floor.ranks[floor.worst_rank]
            lines += ["", f"lower bound, not an engine a pack runs in: under DeepSeek's design floor ({floor.engine}: "
                          f"{floor.kv_bytes_per_token:,.0f} B/token, no engine overhead) rank {worst.rank} would keep "
                          f"{worst.free_gib:.2f} GiB free, largest context {floor.max_context:,} tokens per stream"]
    return "\n".join(lines)


def context_note(planned: int | None, full: int) -> str:
    """The line that says at which context a pack is fitted by default: the one it was planned for, or, for a
    pack that records none, the model's full context (as before packs recorded it)."""
    if planned:
        return f"at {planned:,} tokens per stream, {PLANNED}"
    return (f"at the model's full context, {full:,} tokens per stream: this pack records no planned context (it was "
            "built without --sparks, or by a quantizer before packs recorded it)")
