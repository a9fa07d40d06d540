"""The 128-block Hadamard rotations EXL3 applies on both sides of a weight.

The matrix is Sylvester's natural-order Hadamard, H[i, j] = (-1)^popcount(i & j), scaled by 1/sqrt(128):
symmetric and its own inverse, so the same call rotates and un-rotates.
"""

from __future__ import annotations

import math

import torch

from quantizer.caches import process_cache
from quantizer.exl3 import HADAMARD_BLOCK as BLOCK


@process_cache(maxsize=1)
def _hadamard_cpu() -> torch.Tensor:
    i = torch.arange(BLOCK)
    a = i.view(-1, 1) & i.view(1, -1)
    parity = torch.zeros_like(a)
    for bit in range(7):
        parity ^= (a >> bit) & 1
    return (1 - 2 * parity).to(torch.float32) / math.sqrt(BLOCK)


def hadamard_128(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [128, 128] orthonormal Sylvester Hadamard."""
    return _hadamard_cpu().to(device)


def _check(size: int, what: str) -> None:
    if size % BLOCK:
        raise ValueError(f"{what} = {size} is not a multiple of {BLOCK}; EXL3 rotates in {BLOCK}-wide blocks")


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """(blockdiag H) @ x for x [k, n] float32: mixes each 128-row block (the input side)."""
    k, n = x.shape
    _check(k, "rows")
    return (hadamard_128(x.device) @ x.reshape(k // BLOCK, BLOCK, n)).reshape(k, n)


def rotate_cols(x: torch.Tensor) -> torch.Tensor:
    """x @ (blockdiag H) for x [k, n] float32: mixes each 128-column block (the output side)."""
    k, n = x.shape
    _check(n, "columns")
    return (x.reshape(k, n // BLOCK, BLOCK) @ hadamard_128(x.device)).reshape(k, n)
