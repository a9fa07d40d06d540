"""Our tile kernel's search, run on a CPU, against exllamav3's search written out in numpy.

tests/encoder_kernel_host.cpp compiles the per-thread functions of quantizer/codec/kernel/trellis_encode.cu
for the host and runs them thread by thread between the kernel's barriers. `reference_encode` below is the
search exllamav3 1.6.5's generic kernel does (docs/encoder.md, "Our tile kernel"; docs/exl3-format.md,
encoder): every step records the first predecessor of least cost for every edge, the traceback follows those
records. The kernel stores only the least costs and recomputes the choice; the two must give the same
states. The codebook values come from quantizer.exl3.codebook_values (the decode proven against exllamav3's
on the GPU), not from the kernel's decode.

This checks the kernel's indexing, passes, stored steps and tie rules with no GPU; whether the CUDA build
computes the same on a device is tests/gpu/test_encoder_kernel.py's question.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from quantizer.exl3 import codebook_values

ROOT = Path(__file__).resolve().parents[1]
HOST = Path(__file__).with_name("encoder_kernel_host.cpp")
KERNEL_DIR = ROOT / "quantizer" / "codec" / "kernel"
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
L = 256
FULL_GRID = "QUANTIZER_KERNEL_GRID"  # CI runs K 2 mul1; the grid is run where the kernel changes


def rank(e: np.ndarray) -> np.ndarray:
    """exllamav3's order over equal final costs: bit-reversed warp, then bit-reversed lane, then stripe."""
    def rev5(x):
        return sum(((x >> b) & 1) << (4 - b) for b in range(5))
    low = e & 1023
    return (rev5(low >> 5) << 10) | (rev5(low & 31) << 5) | (e >> 10)


def rate_widths(K: float) -> tuple[int, int]:
    """(KA, KB): bits shifted in at even and odd positions (KB = KA at integer K, KA + 1 at KA + 0.5)."""
    ka = int(K)
    return ka, ka + (K != ka)


def reference_encode(tile: np.ndarray, K: float, codebook: str) -> tuple[np.ndarray, np.ndarray]:
    """(states uint16 [256], values float32 [256]) by the argmin-recording two-pass search."""
    values = codebook_values(codebook).numpy()  # float16 [65536]
    ka, kb = rate_widths(K)
    w = tile.astype(np.float16)
    inf = np.float16(np.inf)

    def width(p: int) -> int:  # D(p): the bits position p shifts in
        return kb if p % 2 else ka

    def candidates(p: int):  # out-edges of position p, their candidate states and predecessors
        kin, kout = width(p), width((p + 1) % L)
        e = np.arange(65536 >> kout)
        s = (np.arange(1 << kout)[:, None] << (16 - kout)) | e
        return e, s, s >> kin

    def forward(roll: int, pre: int):
        record, cost = {}, None
        for i in range(L):
            ri = (i + roll) % L
            e, s, pred = candidates(ri)
            d = values[s] - w[ri]  # float16 op: exact difference rounded once
            if cost is None:  # (|d| above 256 squares to inf in fp16, as on the GPU)
                with np.errstate(over="ignore"):
                    c = (d.astype(np.float32) * d.astype(np.float32)).astype(np.float16)
                if pre >= 0:
                    c[pred != pre] = inf
            else:  # fused: the exact d*d + cost rounded once
                with np.errstate(over="ignore"):
                    c = (d.astype(np.float64) ** 2 + cost[pred].astype(np.float64)).astype(np.float16)
            arg = np.argmin(c, axis=0)  # first index of the least
            record[ri] = pred[arg, e]
            cost = c[arg, e]
        return record, cost

    def backward(record, roll: int, edge: int, write: bool):
        states, vals = np.zeros(L, np.uint16), np.zeros(L, np.float32)
        for i in range(L - 1, -1, -1):
            ri = (i + roll) % L
            prev = int(record[ri][edge])
            state = ((prev << width(ri)) | edge) & 0xFFFF
            edge = prev
            if write:
                states[ri], vals[ri] = state, values[state]
            elif ri == 0:
                break
        return edge, states, vals

    record, cost = forward(L // 2, -1)
    e = np.arange(len(cost))
    key = (cost.view(np.uint16).astype(np.int64) << 16) | rank(e)
    best = int(key.min())
    last = 0 if best >= 0x7C000000 else int(e[np.argmin(key)])
    boundary, _, _ = backward(record, L // 2, last, False)
    record, _ = forward(0, boundary)
    _, states, vals = backward(record, 0, boundary, True)
    return states, vals


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (g++)")
    exe = tmp_path_factory.mktemp("encoder_kernel_host") / "encoder_kernel_host"
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{KERNEL_DIR}", str(HOST), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    return exe


def host_encode(exe: Path, tiles: np.ndarray, K: float, codebook: str) -> tuple[np.ndarray, np.ndarray]:
    n = len(tiles)
    data = struct.pack("<4i", n, *rate_widths(K), CODEBOOKS[codebook]) + tiles.astype("<f4").tobytes()
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    states = np.frombuffer(out[: n * L * 2], dtype="<i2").view(np.uint16).reshape(n, L)
    vals = np.frombuffer(out[n * L * 2:], dtype="<f4").reshape(n, L)
    return states, vals


def tiles_for(seed: int, codebook: str, random: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    gauss = rng.standard_normal((random, L))
    zero = np.zeros((1, L))
    # codebook values at random states: exact matches (zero-error steps)
    on_codebook = codebook_values(codebook).numpy().astype(np.float32)[rng.integers(0, 65536, L)][None]
    # |w| about 13: path costs in the tens of thousands, where an fp16 step is 16-32, so many candidates tie
    # exactly and only the same first-index rule gives the same codes (a rule that prefers the last tied
    # candidate changes these tiles' codes, not the others')
    coarse = (13.0 + 0.5 * rng.standard_normal((1, L))) * rng.choice([-1.0, 1.0], (1, L))
    big = rng.standard_normal((1, L)) * 1e4  # squared errors overflow to inf: every cost ties at inf
    return np.concatenate([gauss, zero, on_codebook, coarse, big]).astype(np.float32)


def check(exe: Path, K: float, codebook: str, seed: int, random: int = 2) -> None:
    tiles = tiles_for(seed, codebook, random)
    states, vals = host_encode(exe, tiles, K, codebook)
    for n, tile in enumerate(tiles):
        ref_states, ref_vals = reference_encode(tile, K, codebook)
        differ = np.nonzero(states[n] != ref_states)[0]
        assert differ.size == 0, f"tile {n}: {differ.size} positions differ, first {differ[:5].tolist()}"
        assert np.array_equal(vals[n], ref_vals)


def test_mul1_k2_matches_reference(host_kernel):
    check(host_kernel, 2, "mul1", seed=2, random=1)


def test_mul1_half_rate_matches_reference(host_kernel):
    """K 2.5: KA-wide and KB-wide steps in turn, the history keeping the even (narrower) steps only."""
    check(host_kernel, 2.5, "mul1", seed=25, random=1)


def test_half_rate_needs_mul1(host_kernel):
    data = struct.pack("<4i", 1, 2, 3, CODEBOOKS["mcg"]) + np.zeros(L, "<f4").tobytes()
    out = subprocess.run([str(host_kernel)], input=data, capture_output=True)
    assert out.returncode == 2 and out.stderr == b"rate (2, 3) codebook 1 not built\n"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(FULL_GRID), reason=f"the whole K and codebook grid takes about 6 minutes on "
                    f"2 cores; {FULL_GRID}=1 runs it (docs/encoder.md)")
@pytest.mark.parametrize(("K", "codebook"), [(K, cb) for K in (1, 2, 3, 4, 5, 6) for cb in ("3inst", "mcg", "mul1")]
                         + [(K, "mul1") for K in (1.5, 2.5, 3.5)])
def test_every_k_and_codebook_matches_reference(host_kernel, K, codebook):
    check(host_kernel, K, codebook, seed=100 + int(2 * K))


@pytest.mark.parametrize("K", [2, 2.5])
def test_reference_search_is_a_viterbi(K):
    """The reference is worth comparing with: on a tile that is itself a valid ring of codebook states (random
    trellis words unpacked), the two-pass search finds a zero-error encoding (every value reproduced
    exactly), and its states form a ring of the rate's widths."""
    import torch

    from quantizer.codec.trellis import step_bits, unpack_trellis, words_per_tile

    values = codebook_values("mul1").numpy()
    g = torch.Generator().manual_seed(5)
    words = torch.randint(-(1 << 15), 1 << 15, (words_per_tile(K),), dtype=torch.int16, generator=g)
    tile = values[unpack_trellis(words, K).numpy()].astype(np.float32)
    states, vals = reference_encode(tile, K, "mul1")
    assert np.array_equal(vals, tile)
    shift = step_bits(K)
    assert all(((int(states[p - 1]) << shift[p]) & 0xFFFF) >> shift[p] == int(states[p]) >> shift[p] for p in range(L))
