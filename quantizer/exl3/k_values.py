"""The K values EXL3 can store, and which of them one tensor may take.

A trellis stores exactly K bits per weight: integer K 1..8 with any codebook, half rates 1.5, 2.5
and 3.5 with mul1 only (docs/exl3-format.md, rates). A plan may also keep a linear as plain fp16
(K 16, `UNQUANTIZED`). exllamav3's DeepSeek-V4 attention takes integer K only. Every bad K is a
UserError: a K reaches here from a plan, a recipe or a flag.
"""

from __future__ import annotations

import math

from quantizer.errors import UserError
from quantizer.exl3.codebook import Codebook, parse_codebook

INTEGER_RATES = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)  # mul1 only
UNQUANTIZED = 16.0  # recipe value: keep the linear as fp16


def k_words(k: float | None) -> str:
    """A plan's K for one tensor group as a person reads it: "6 bits", "fp16", "source form" (None)."""
    if k is None:
        return "in source form"
    return "fp16" if k == UNQUANTIZED else f"{k:g} bits"


def rate_grid(codebook: Codebook | str, integer_only: bool = False) -> tuple[float, ...]:
    """The K values one tensor may take (exllamav3: half rates only with mul1, none for DSV4 attention)."""
    if parse_codebook(codebook) is Codebook.MUL1 and not integer_only:
        return tuple(sorted(float(k) for k in INTEGER_RATES + HALF_RATES))
    return tuple(float(k) for k in INTEGER_RATES)


def trellis_k(K: float, codebook: Codebook | str = Codebook.MUL1) -> int | float:
    """K as a trellis stores it: int for 1..8, float for 1.5, 2.5, 3.5 (mul1 only)."""
    cb = parse_codebook(codebook)
    try:
        k = float(K)
    except (TypeError, ValueError):
        raise UserError(f"K {K!r} is not a number; use 1..8 or 1.5, 2.5, 3.5") from None
    if k.is_integer() and int(k) in INTEGER_RATES:
        return int(k)
    if k in HALF_RATES:
        if cb is not Codebook.MUL1:
            raise UserError(f"K {k:g} needs the mul1 codebook (got {cb.value}); half rates are mul1-only")
        return k
    raise UserError(f"K {K!r} is not an EXL3 rate; use 1..8 or 1.5, 2.5, 3.5")


def check_k(k: float, codebook: Codebook | str, integer_only: bool, what: str) -> float:
    """K as a float if one tensor may take it (a trellis rate, or 16 = fp16), else a UserError naming `what`."""
    k = float(k)
    if k == UNQUANTIZED:
        return k
    if k in HALF_RATES and integer_only:
        raise UserError(f"{what}: K {k:g} is a half rate, but DSV4 attention takes integer K only (1..8)")
    if not (k.is_integer() and int(k) in INTEGER_RATES) and k not in HALF_RATES:
        raise UserError(f"{what}: K {k:g} is not an EXL3 rate; use 1..8, 1.5/2.5/3.5 (mul1), 16 or native")
    try:
        return float(trellis_k(k, codebook))
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


def check_bpw(bpw: float, codebook: Codebook | str, what: str = "--bpw") -> None:
    """A UserError naming `what` unless `bpw` is a finite number above 0 and at most the highest rate."""
    highest = rate_grid(codebook)[-1]
    if not (math.isfinite(bpw) and 0 < bpw <= highest):
        raise UserError(f"{what} {bpw:g}: must be a number above 0 and at most {highest:g} (the highest EXL3 rate)")


def rate_floor(x: float, grid: tuple[float, ...]) -> float:
    """The largest rate of `grid` at or below x (the smallest rate if x is below them all)."""
    below = [r for r in grid if r <= x + 1e-9]
    return below[-1] if below else grid[0]


def drafter_k(bits: float | None, integer_only: bool) -> float | None:
    """The drafter's rate; its attention rounds down to an integer (DSV4 attention)."""
    if bits is None:
        return None
    return rate_floor(bits, rate_grid("mcg")) if integer_only else bits
