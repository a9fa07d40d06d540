"""Plain-text tables and human sizes for the CLI's reports."""

from __future__ import annotations

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def size_text(n: float) -> str:
    """A byte count a person reads at a glance: 512 B, 3.4 KiB, 5.1 MiB, 196.08 GiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}" if unit == "GiB" else f"{n / scale:,.1f} {unit}"
    return f"{int(n):,} B"


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A fixed-width table; columns in `right` (default: all but the first) are right-aligned."""
    right = set(range(1, len(headers))) if right is None else right
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
