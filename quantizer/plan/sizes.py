"""Bytes of EXL3 and native tensors, and bits-per-weight accounting.

An EXL3 linear (ref/exllamav3-internals.md 2.3) stores `trellis` int16 [in/16, out/16, 16*K]
(exactly K bits per weight), `suh` fp16 [in], `svh` fp16 [out] and a one-int32 codebook marker
(`.mul1` or `.mcg`; none for 3INST). K 16 means an unquantized fp16 weight. Native tensors keep the
bytes of their TensorSpec. Overheads are why a pack's stored bpw sits a little above its K.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from quantizer.errors import UserError
from quantizer.model.layout import TensorSpec

CODEBOOKS = ("mul1", "mcg", "3inst")
MARKERS = {"mul1": "mul1", "mcg": "mcg"}  # 3INST has no marker tensor
EXL3_LEAVES = ("trellis", "suh", "svh", "mul1", "mcg", "bias")
INTEGER_RATES = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)  # mul1 only
UNQUANTIZED = 16.0  # recipe value: keep the linear as fp16


def rate_grid(codebook: str, integer_only: bool = False) -> tuple[float, ...]:
    """The K values one tensor may take (exllamav3: half rates only with mul1, none for DSV4 attention)."""
    if codebook == "mul1" and not integer_only:
        return tuple(sorted(float(k) for k in INTEGER_RATES + HALF_RATES))
    return tuple(float(k) for k in INTEGER_RATES)


_GRIDS = {(cb, i): rate_grid(cb, i) for cb in CODEBOOKS for i in (False, True)}


def check_k(k: float, codebook: str, integer_only: bool, what: str) -> float:
    """K as a float if one tensor may take it (or 16 = fp16), else a UserError naming `what`."""
    k = float(k)
    if k == UNQUANTIZED or k in _GRIDS.get((codebook, integer_only), ()):
        return k
    if k in HALF_RATES and integer_only:
        raise UserError(f"{what}: K {k:g} is a half rate, but DSV4 attention takes integer K only (1..8)")
    if k in HALF_RATES:
        raise UserError(f"{what}: K {k:g} needs the mul1 codebook (this plan uses {codebook})")
    raise UserError(f"{what}: K {k:g} is not an EXL3 rate; use 1..8, 1.5/2.5/3.5 (mul1), 16 or native")


def exl3_leaves(key: str, in_features: int, out_features: int, k: float, codebook: str) -> list[TensorSpec]:
    """The tensors one EXL3 linear stores (or its fp16 weight when K is 16)."""
    return [TensorSpec(key + suffix, shape, dtype)
            for suffix, shape, dtype, _ in leaf_layout(in_features, out_features, k, codebook)]


@lru_cache(maxsize=256)
def leaf_layout(
    in_features: int, out_features: int, k: float, codebook: str
) -> tuple[tuple[str, tuple, str, int], ...]:
    """(suffix, shape, dtype, bytes) of each stored leaf; shared by every linear of one shape and K."""
    if k == UNQUANTIZED:
        leaves = [(".weight", (out_features, in_features), "F16")]
    else:
        words = Fraction(k) * 16
        if words.denominator != 1:
            raise ValueError(f"K {k} is not a multiple of 1/16")
        leaves = [
            (".trellis", (in_features // 16, out_features // 16, int(words)), "I16"),
            (".suh", (in_features,), "F16"),
            (".svh", (out_features,), "F16"),
        ]
        if codebook in MARKERS:
            leaves.append((f".{MARKERS[codebook]}", (), "I32"))
    return tuple((suffix, shape, dtype, TensorSpec("", shape, dtype).nbytes) for suffix, shape, dtype in leaves)


def exl3_bytes(in_features: int, out_features: int, k: float, codebook: str = "mul1") -> int:
    """Stored bytes of one EXL3 linear: in*out*K/8 + 2*in + 2*out + 4 (marker)."""
    return sum(leaf[3] for leaf in leaf_layout(in_features, out_features, k, codebook))


def native_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def k_from_trellis(shape: tuple[int, ...]) -> float:
    """K of a stored trellis: its last dimension is 16*K words (40 for K 2.5)."""
    return shape[-1] / 16


def budget_bpw(items: list[tuple[int, float]]) -> float:
    """exllamav3's `bits` figure: sum(numel*K) / sum(numel) over (numel, K) of budgeted tensors."""
    total = sum(n for n, _ in items)
    return sum(n * k for n, k in items) / total if total else 0.0
