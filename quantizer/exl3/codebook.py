"""EXL3 codebooks: the fp16 value of each 16-bit trellis state, and the marker that names one in a pack.

A codebook is a fixed function of the state (docs/exl3-format.md, codebooks), so it is tabulated once: 65,536
fp16 values per codebook. The table is built with exact integer and float64 arithmetic and rounded to
fp16 once, which is what the CUDA kernels compute (one fp16 rounding per value).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from quantizer.caches import process_cache
from quantizer.errors import UserError

NUM_STATES = 1 << 16

# Stored next to the trellis as an int32 scalar; only the presence of the key selects the codebook.
MUL1_MULTIPLIER = 0x83DCD12D
MCG_MULTIPLIER = 0xCBAC1FED
_INST3_MULTIPLIER = 89226354
_INST3_ADDEND = 64248484


class Codebook(str, enum.Enum):
    """Which function maps a trellis state to its value; 3INST is the one with no stored marker."""

    MUL1 = "mul1"
    MCG = "mcg"
    INST3 = "3inst"

    @property
    def marker(self) -> int | None:
        """The multiplier stored as `<key>.mul1` / `<key>.mcg` (None for 3INST, which stores nothing)."""
        return {Codebook.MUL1: MUL1_MULTIPLIER, Codebook.MCG: MCG_MULTIPLIER}.get(self)


CODEBOOKS = tuple(c.value for c in Codebook)


def parse_codebook(codebook: Codebook | str) -> Codebook:
    """Accept a Codebook or its name; anything else is a clear error."""
    try:
        return Codebook(codebook)
    except ValueError:
        raise UserError(f"unknown EXL3 codebook {codebook!r}; use one of {', '.join(CODEBOOKS)}") from None


def _fp16_bits(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


@process_cache(maxsize=len(Codebook))
def _table(codebook: Codebook) -> torch.Tensor:
    s = np.arange(NUM_STATES, dtype=np.uint64)
    if codebook is Codebook.MUL1:
        x = (s * MUL1_MULTIPLIER) & 0xFFFFFFFF
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        # hfma((1024 + c), h(0x1EEE), h(0xC931)): exact in float64, then one rounding to fp16.
        v = ((1024 + byte_sum).astype(np.float64) * _fp16_bits(0x1EEE) + _fp16_bits(0xC931)).astype(np.float16)
    else:
        if codebook is Codebook.MCG:
            x = (s * MCG_MULTIPLIER) & 0xFFFFFFFF
        else:
            x = (s * _INST3_MULTIPLIER + _INST3_ADDEND) & 0xFFFFFFFF
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
        hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
        # Both halves have exponents within 3 of each other, so the float32 sum is exact: one rounding.
        v = (lo + hi).astype(np.float16)
    return torch.from_numpy(v)


def codebook_values(codebook: Codebook | str, device: torch.device | str | None = None) -> torch.Tensor:
    """fp16 [65536]: the value of every 16-bit state under `codebook`."""
    table = _table(parse_codebook(codebook))
    return table if device is None else table.to(device)
