"""Trellis encoder: tail-biting Viterbi search for the states that best reproduce each tile (CPU or GPU).

The search runs over nodes, not states: after position p only the low 16 - D(p+1) bits of the state
matter for the future, so each step scores all 2^16 candidate states once (entry node cost + squared
error) and keeps the minimum per node: 2^16 operations per weight whatever K is, the same work as
exllamav3's kernel. Nothing is stored per state: the node costs entering each position are kept, and the
backtrace re-scores the 2^D(p+1) candidates of the one node it follows.

Tail-biting (position 0 reads the state of position 255): a first pass from a free start picks the node
at the ring seam, a second pass starts from that node and must end in it, as exllamav3 does. `exact`
runs the first pass over the whole ring (the seam sees 128 positions on each side, like exllamav3);
`fast` runs it over FAST_SEAM_WINDOW positions on each side, about 1.7x less work for ~3 % more error.

On a CPU the same search runs in the compiled kernel of native.py when it builds (4.8-7.1x faster
per core on AVX2, the same states bit for bit); this module's torch search is the fallback and the GPU
path.
Squared errors are computed as (value - w) * (value - w), op by op, so that both paths round alike.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Literal

import torch

from quantizer.caches import process_cache
from quantizer.exl3 import NUM_STATES, Codebook, codebook_values, parse_codebook, trellis_k

from . import native
from .trellis import TILE_POSITIONS, step_bits

EncoderMode = Literal["exact", "fast"]
ENCODER_MODES: tuple[str, ...] = ("exact", "fast")

FAST_SEAM_WINDOW = 16
_EXACT_SEAM_WINDOW = TILE_POSITIONS // 2
_TRANSPOSED_MAX_D = 5  # candidate layout [new bits, entry node] up to here, [entry node, new bits] above
# Tiles searched together (per worker): a few megabytes of candidates per step on a CPU, where larger
# chunks only add cache misses; as many as the entry costs (up to 32 MiB a tile) allow in 1 GiB on a GPU.
_CPU_CHUNK_TILES, _CPU_CHUNK_BYTES = 16, 256 << 20
_GPU_CHUNK_TILES, _GPU_CHUNK_BYTES = 256, 1 << 30


@process_cache(maxsize=64)  # (codebook, device, bits per step)
def _grids(codebook: Codebook, device: torch.device, d: int) -> torch.Tensor:
    """Codebook values laid out as the step for D = d reads them."""
    grid = codebook_values(codebook).to(device=device, dtype=torch.float32).view(NUM_STATES >> d, 1 << d)
    if d <= _TRANSPOSED_MAX_D:
        grid = grid.t().contiguous()
    return grid


class _Search:
    """Workspace for one chunk of tiles: codebook tables, candidate buffer, and the entry cost of every position."""

    def __init__(self, codebook: Codebook, K: float, tiles: int, device: torch.device):
        self.ds = step_bits(K)
        self.values = codebook_values(codebook).to(device=device, dtype=torch.float32)
        self.grids = {d: _grids(codebook, device, d) for d in set(self.ds)}
        self.entry = torch.empty(TILE_POSITIONS, tiles, NUM_STATES >> min(self.ds), device=device)
        self.cand = torch.empty(tiles, NUM_STATES, device=device)

    def _next(self, p: int) -> int:
        return self.ds[(p + 1) % TILE_POSITIONS]

    def _entry(self, p: int, t: int) -> torch.Tensor:
        """Node costs entering position p (indexed by the low 16 - D(p) bits of the previous state)."""
        return self.entry[p, :t, : NUM_STATES >> self.ds[p]]

    def _step(self, cost: torch.Tensor, w: torch.Tensor, d: int, d_next: int, out: torch.Tensor) -> None:
        """out = node costs after one position: min over the top d_next bits of cost[s >> d] + err(s)."""
        t = cost.shape[0]
        grid = self.grids[d]
        c = self.cand[:t].view(t, *grid.shape)
        torch.sub(grid, w.view(t, 1, 1), out=c)
        c.square_()  # (value - w)^2, rounded op by op exactly as the C++ kernel does
        if d <= _TRANSPOSED_MAX_D:
            c += cost.unsqueeze(1)
            c = c.view(t, 1 << d, 1 << d_next, -1)  # [new bits, top bits, low bits of entry node]
            m = torch.minimum(c[:, :, 0], c[:, :, 1]) if d_next == 1 else c.amin(2)
            out.view(t, -1, 1 << d).copy_(m.transpose(1, 2))  # new node = low bits << d | new bits
        else:
            c += cost.unsqueeze(2)
            c = c.view(t, 1 << d_next, -1)
            torch.amin(c, 1, out=out)

    def forward(self, tiles: torch.Tensor, order: list[int], start: torch.Tensor) -> torch.Tensor:
        """Run positions `order` (a contiguous ring segment) from entry costs `start`; return the final costs."""
        t = tiles.shape[0]
        self._entry(order[0], t).copy_(start)
        final = torch.empty(t, NUM_STATES >> self._next(order[-1]), device=tiles.device)
        for i, p in enumerate(order):
            out = final if i + 1 == len(order) else self._entry(order[i + 1], t)
            self._step(self._entry(p, t), tiles[:, p], self.ds[p], self._next(p), out)
        return final

    def backtrace(self, tiles, positions, node, states=None) -> torch.Tensor:
        """Follow the best path back from `node` (after the last position); return the node before the first.

        Writes the chosen state of each position into `states` when given.
        """
        t = tiles.shape[0]
        for p in reversed(positions):
            d, d_next = self.ds[p], self._next(p)
            s = (torch.arange(1 << d_next, device=node.device) << (16 - d_next)) | node.unsqueeze(1)
            c = self._entry(p, t).gather(1, s >> d) + (self.values[s] - tiles[:, p : p + 1]).square()
            s = s.gather(1, c.argmin(1, keepdim=True)).squeeze(1)
            if states is not None:
                states[:, p] = s
            node = s >> d
        return node

    def encode(self, tiles: torch.Tensor, seam: int) -> torch.Tensor:
        t, device = tiles.shape[0], tiles.device
        # Pass 1: free start `seam` positions before the ring seam, free end `seam` positions after it.
        window = list(range(TILE_POSITIONS - seam, TILE_POSITIONS)) + list(range(seam))
        free = torch.zeros(t, NUM_STATES >> self.ds[window[0]], device=device)
        end = self.forward(tiles, window, free).argmin(1)
        seam_node = self.backtrace(tiles, list(range(seam)), end)
        # Pass 2: the whole ring, leaving from and returning to the seam node.
        start = torch.full((t, NUM_STATES >> self.ds[0]), float("inf"), device=device)
        start.scatter_(1, seam_node.unsqueeze(1), 0.0)
        ring = list(range(TILE_POSITIONS))
        self.forward(tiles, ring, start)
        states = torch.empty(t, TILE_POSITIONS, dtype=torch.int64, device=device)
        self.backtrace(tiles, ring, seam_node, states)
        return states.to(torch.int32)


@process_cache(maxsize=1)
def _workspaces(codebook: Codebook, K: float, device: torch.device, workers: int) -> tuple[_Search, ...]:
    """Workspaces kept between calls (LDLQ calls once per strip): 256 MiB in all on a CPU, 1 GiB on a GPU."""
    entry_bytes = 4 * TILE_POSITIONS * (NUM_STATES >> min(step_bits(K)))
    cpu = device.type == "cpu"
    tiles = _CPU_CHUNK_TILES if cpu else _GPU_CHUNK_TILES
    budget = (_CPU_CHUNK_BYTES if cpu else _GPU_CHUNK_BYTES) // workers
    return tuple(_Search(codebook, K, max(1, min(tiles, budget // entry_bytes)), device) for _ in range(workers))


def _encode_slice(search: _Search, tiles: torch.Tensor, seam: int) -> torch.Tensor:
    chunk = search.entry.shape[1]
    return torch.cat([search.encode(tiles[i : i + chunk], seam) for i in range(0, tiles.shape[0], chunk)])


@process_cache(maxsize=1)
def _pool(workers: int) -> ThreadPoolExecutor:
    """Worker threads kept for the process: LDLQ encodes once per 16-row strip."""
    return ThreadPoolExecutor(workers, thread_name_prefix="exl3-encode")


@contextmanager
def _one_torch_thread():
    """Ops on one thread each while our own workers share the cores: torch's own threads wait for each other
    at every op, which collapses (10-100x) as soon as another process competes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


@process_cache(maxsize=4)
def _values_cpu(codebook: Codebook) -> torch.Tensor:
    return codebook_values(codebook).to(torch.float32).contiguous()


def _encode_torch(tiles: torch.Tensor, K: float, codebook: Codebook, seam: int) -> torch.Tensor:
    """The torch search: one workspace on a GPU, torch.get_num_threads() worker threads on a CPU."""
    if tiles.device.type != "cpu":
        return _encode_slice(_workspaces(codebook, K, tiles.device, 1)[0], tiles, seam)
    with _one_torch_thread() as threads:
        searches = _workspaces(codebook, K, tiles.device, threads)
        slices = tiles.tensor_split(min(len(searches), tiles.shape[0]))
        return torch.cat(list(_pool(len(searches)).map(_encode_slice, searches, slices, [seam] * len(slices))))


def _encode_native(tiles: torch.Tensor, K: float, codebook: Codebook, seam: int) -> torch.Tensor | None:
    """The compiled search on CPU tiles (torch.get_num_threads() threads), or None where it is unavailable."""
    kernel = native.kernel() if tiles.device.type == "cpu" else None
    if kernel is None:
        return None
    return kernel.encode_tiles(tiles, _values_cpu(codebook), step_bits(K), seam, torch.get_num_threads())


def encode_tiles(
    tiles: torch.Tensor,
    K: float,
    codebook: Codebook | str = Codebook.MUL1,
    mode: EncoderMode = "fast",
) -> torch.Tensor:
    """Tail-biting trellis states for tiles (N, 256) given in trellis position order.

    Returns int32 (N, 256) ring-consistent states: pack_trellis stores them exactly, and
    codebook_values(codebook)[states] is the reconstruction. Works on the tiles' device; on a CPU it
    uses torch.get_num_threads() threads.
    """
    cb = parse_codebook(codebook)
    k = trellis_k(K, cb)
    if mode not in ENCODER_MODES:
        raise ValueError(f"unknown encoder mode {mode!r}; use one of {', '.join(ENCODER_MODES)}")
    if tiles.dim() != 2 or tiles.shape[1] != TILE_POSITIONS:
        raise ValueError(f"tiles must be (N, {TILE_POSITIONS}), got {tuple(tiles.shape)}")
    tiles = tiles.to(torch.float32)
    if not torch.isfinite(tiles).all():
        raise ValueError("tiles contain NaN or inf; the trellis encoder needs finite values")
    if tiles.shape[0] == 0:
        return torch.empty(0, TILE_POSITIONS, dtype=torch.int32, device=tiles.device)
    seam = _EXACT_SEAM_WINDOW if mode == "exact" else FAST_SEAM_WINDOW
    states = _encode_native(tiles, k, cb, seam)
    return states if states is not None else _encode_torch(tiles, k, cb, seam)
