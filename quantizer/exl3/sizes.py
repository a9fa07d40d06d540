"""What one EXL3 linear stores, its bytes, K read back from a trellis shape, and bpw accounting.

An EXL3 linear (docs/exl3-format.md, stored tensors) stores `trellis` int16 [in/16, out/16, 16*K]
(exactly K bits per weight), `suh` fp16 [in], `svh` fp16 [out] and a one-int32 codebook marker
(`.mul1` or `.mcg`; none for 3INST). K 16 means an unquantized fp16 weight. Overheads are why a
pack's stored bpw sits a little above its K.
"""

from __future__ import annotations

from fractions import Fraction

from quantizer.caches import process_cache
from quantizer.exl3.codebook import Codebook, parse_codebook
from quantizer.exl3.k_values import UNQUANTIZED

# The leaves only an encoded linear stores (its trellis, scales and codebook marker); a `.bias` is stored
# beside them, but as the plain tensor any linear may have.
EXL3_QUANTIZED_LEAVES = ("trellis", "suh", "svh", "mul1", "mcg")
EXL3_LEAVES = (*EXL3_QUANTIZED_LEAVES, "bias")  # every leaf stored under an EXL3 linear's key
HADAMARD_BLOCK = 128  # EXL3 rotates 128-wide Hadamard blocks: in and out features must be multiples
PACK_ALIGN = 64  # every tensor of a pack starts at a 64-byte offset (docs/exl3-format.md, alignment)


@process_cache(maxsize=256)
def leaf_layout(
    in_features: int, out_features: int, k: float, codebook: Codebook | str
) -> tuple[tuple[str, tuple, str, int], ...]:
    """(suffix, shape, dtype, bytes) of each stored leaf; shared by every linear of one shape and K."""
    if k == UNQUANTIZED:
        return ((".weight", (out_features, in_features), "F16", 2 * in_features * out_features),)
    words = Fraction(k) * 16
    if words.denominator != 1:
        raise ValueError(f"K {k} is not a multiple of 1/16")
    trellis = (in_features // 16, out_features // 16, int(words))
    leaves = [
        (".trellis", trellis, "I16", 2 * trellis[0] * trellis[1] * trellis[2]),
        (".suh", (in_features,), "F16", 2 * in_features),
        (".svh", (out_features,), "F16", 2 * out_features),
    ]
    cb = parse_codebook(codebook)
    if cb.marker is not None:
        leaves.append((f".{cb.value}", (), "I32", 4))
    return tuple(leaves)


def exl3_bytes(in_features: int, out_features: int, k: float, codebook: Codebook | str = Codebook.MUL1) -> int:
    """Stored bytes of one EXL3 linear: in*out*K/8 + 2*in + 2*out + 4 (marker)."""
    return sum(leaf[3] for leaf in leaf_layout(in_features, out_features, k, codebook))


def k_from_trellis(shape: tuple[int, ...]) -> float:
    """K of a stored trellis: its last dimension is 16*K words (40 for K 2.5)."""
    return shape[-1] / 16


def budget_bpw(items: list[tuple[int, float]]) -> float:
    """exllamav3's `bits` figure: sum(numel*K) / sum(numel) over (numel, K) of budgeted tensors."""
    total = sum(n for n, _ in items)
    return sum(n * k for n, k in items) / total if total else 0.0
