"""The EXL3 trellis bit stream: which bits each of a tile's 256 positions adds, and how they are stored.

A 16x16 tile is a ring of R = 256*K bits. Position p appends D(p) bits (K, or KA/KA+1 alternating for
half rates K = KA + 0.5), and its 16-bit state is the window of ring bits that ends where its own bits end
(docs/exl3-format.md, the decode, steps 1-3). The ring is stored MSB-first in 32-bit words, each word as two little-endian
int16: word i = u16[2i] | u16[2i+1] << 16. Positions map to tile elements in tensor-core order (step 5).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from quantizer.caches import process_cache
from quantizer.exl3 import trellis_k

TILE = 16
TILE_POSITIONS = TILE * TILE
STATE_MASK = 0xFFFF
_CHUNK_TILES = 8192


@process_cache(maxsize=32)  # every K of the grid, half rates included
def step_bits(K: float) -> tuple[int, ...]:
    """D(p): bits position p adds to the ring; half rates alternate KA (even p) and KA+1 (odd p)."""
    k = trellis_k(K)
    ka = int(k)
    return tuple(ka + (p & 1) * int(k != ka) for p in range(TILE_POSITIONS))


def words_per_tile(K: float) -> int:
    """int16 words per tile: 16*K (40 for K=2.5)."""
    return sum(step_bits(K)) // 16


def _window_ends(K: float) -> tuple[int, ...]:
    """S(p): the ring bit just past position p's bits (prefix sum of D)."""
    return tuple(accumulate(step_bits(K)))


@process_cache(maxsize=1)
def tile_element_order() -> torch.Tensor:
    """Row-major tile element (r*16 + c) of each trellis position p, the kernels' tensor-core order."""
    order = []
    for p in range(TILE_POSITIONS):
        t, j = p >> 3, p & 7
        r = 2 * (t & 3) + (j & 1) + 8 * ((j >> 1) & 1)
        c = (t >> 2) + 8 * ((j >> 2) & 1)
        order.append(r * TILE + c)
    return torch.tensor(order, dtype=torch.long)


@process_cache(maxsize=64)  # (K, device)
def _unpack_index(K: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = words_per_tile(K) * 16
    starts = torch.tensor([(s - 16) % ring for s in _window_ends(K)], dtype=torch.long)
    word = starts >> 5
    return word.to(device), ((word + 1) % (ring // 32)).to(device), (32 - (starts & 31)).to(device)


@process_cache(maxsize=64)  # (K, device)
def _pack_index(K: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    position, shift = [], []
    for p, d in enumerate(step_bits(K)):
        for j in range(d):
            position.append(p)
            shift.append(d - 1 - j)
    return torch.tensor(position, device=device), torch.tensor(shift, device=device)


def _chunks(x: torch.Tensor):
    flat = x.reshape(-1, x.shape[-1])
    for i in range(0, flat.shape[0], _CHUNK_TILES):
        yield flat[i : i + _CHUNK_TILES]


def unpack_trellis(trellis: torch.Tensor, K: float) -> torch.Tensor:
    """int16 (..., 16K) -> int32 (..., 256): the 16-bit state of every position of every tile."""
    words = words_per_tile(K)
    if trellis.dtype != torch.int16 or trellis.shape[-1] != words:
        raise ValueError(f"trellis must be int16 (..., {words}) for K={K}, got {trellis.dtype} {tuple(trellis.shape)}")
    first, second, shift = _unpack_index(K, trellis.device)
    out = []
    for chunk in _chunks(trellis):
        u = chunk.to(torch.int64) & 0xFFFF
        w = u[:, 0::2] | (u[:, 1::2] << 16)
        # 48 stream bits starting at the window's word: enough for any 16-bit window inside it.
        y = (w[:, first] << 16) | (w[:, second] >> 16)
        out.append(((y >> shift) & STATE_MASK).to(torch.int32))
    return torch.cat(out).reshape(*trellis.shape[:-1], TILE_POSITIONS)


def pack_trellis(states: torch.Tensor, K: float) -> torch.Tensor:
    """int (..., 256) ring-consistent states -> int16 (..., 16K); only each position's new bits are kept."""
    if states.shape[-1] != TILE_POSITIONS:
        raise ValueError(f"states must have {TILE_POSITIONS} positions per tile, got shape {tuple(states.shape)}")
    position, shift = _pack_index(K, states.device)
    weights = torch.arange(31, -1, -1, device=states.device)
    out = []
    for chunk in _chunks(states):
        bits = (chunk.to(torch.int64)[:, position] >> shift) & 1
        w = (bits.view(chunk.shape[0], -1, 32) << weights).sum(-1)
        u = torch.stack((w & 0xFFFF, w >> 16), dim=-1).flatten(1)
        out.append(torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16))
    return torch.cat(out).reshape(*states.shape[:-1], words_per_tile(K))


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """(ti, to, 256) values in trellis position order -> (16*ti, 16*to) matrix."""
    ti, to, _ = tiles.shape
    rowmajor = torch.empty_like(tiles)
    rowmajor[..., tile_element_order().to(tiles.device)] = tiles
    return rowmajor.view(ti, to, TILE, TILE).permute(0, 2, 1, 3).reshape(ti * TILE, to * TILE)


def matrix_to_tiles(x: torch.Tensor) -> torch.Tensor:
    """(16*ti, 16*to) matrix -> (ti, to, 256) in trellis position order; inverse of tiles_to_matrix."""
    rows, cols = x.shape
    t = x.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3).reshape(rows // TILE, cols // TILE, -1)
    return t[..., tile_element_order().to(x.device)]
