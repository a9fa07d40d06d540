"""The decoder against the spec (docs/exl3-format.md, the decode), re-derived here in plain Python, one bit at a time."""

import math
import struct

import pytest
import torch

from quantizer.codec import EXL3Linear, decode_rotated, dequantize
from quantizer.codec.hadamard import hadamard_128
from quantizer.exl3 import codebook_values

K_ALL = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)


def _half(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def _round_half(x: float) -> float:
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _spec_value(state: int, codebook: str) -> float:
    if codebook == "mul1":
        x = (state * 0x83DCD12D) & 0xFFFFFFFF
        c = sum((x >> (8 * i)) & 0xFF for i in range(4))
        return _round_half((1024 + c) * _half(0x1EEE) + _half(0xC931))
    x = state * 0xCBAC1FED if codebook == "mcg" else state * 89226354 + 64248484
    x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
    return _round_half(_half(x & 0xFFFF) + _half(x >> 16))


def _step_bits(K) -> list[int]:
    return [int(K) + (p & 1) * (K != int(K)) for p in range(256)]


def _spec_tile(words: list[int], K, codebook: str) -> list[list[float]]:
    """16x16 tile from 16*K uint16 words, following steps 1-5 literally."""
    w32 = [words[2 * i] | words[2 * i + 1] << 16 for i in range(len(words) // 2)]
    bits = [(w >> (31 - j)) & 1 for w in w32 for j in range(32)]
    ring = len(bits)
    tile = [[0.0] * 16 for _ in range(16)]
    end = 0
    for p, d in enumerate(_step_bits(K)):
        end += d
        state = sum(bits[(end - 16 + r) % ring] << (15 - r) for r in range(16))
        t, j = p >> 3, p & 7
        row = 2 * (t & 3) + (j & 1) + 8 * ((j >> 1) & 1)
        col = (t >> 2) + 8 * ((j >> 2) & 1)
        tile[row][col] = _spec_value(state, codebook)
    return tile


def test_codebook_hand_values():
    # mul1(0): x = 0, byte sum 0: 1024 * h(0x1EEE) + h(0xC931) = 6.9296875 - 10.3828125
    assert codebook_values("mul1")[0].item() == -3.453125
    # 3INST(0): x = 0x03D45AA4 -> lop3 -> 0x38B431C4: h(0x31C4) + h(0x38B4) = 0.18017578125 + 0.587890625
    assert codebook_values("3inst")[0].item() == 0.76806640625
    # mcg(1): x = 0xCBAC1FED -> 0xB0CC348D: h(0x348D) + h(0xB0CC) = 0.284423828125 - 0.14990234375
    assert codebook_values("mcg")[1].item() == 0.134521484375


@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_codebook_matches_spec_formula(codebook):
    table = codebook_values(codebook)
    g = torch.Generator().manual_seed(1)
    for s in [0, 1, 2, 0x8000, 0xFFFF] + torch.randint(0, 1 << 16, (200,), generator=g).tolist():
        assert table[s].item() == _spec_value(s, codebook), f"state {s:#06x}"


@pytest.mark.parametrize("K", K_ALL)
def test_decode_one_tile_matches_spec(K):
    codebook = "mul1" if K != int(K) else ("mcg", "3inst", "mul1")[int(K) % 3]
    g = torch.Generator().manual_seed(int(K * 10))
    words = torch.randint(0, 1 << 16, (int(16 * K),), generator=g)
    trellis = torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16).view(1, 1, -1)
    got = decode_rotated(trellis, K, codebook)
    assert got.dtype == torch.float16 and got.shape == (16, 16)
    assert got.tolist() == _spec_tile(words.tolist(), K, codebook)


def test_decode_places_tiles_in_input_by_output_grid():
    g = torch.Generator().manual_seed(2)
    trellis = torch.randint(-(1 << 15), 1 << 15, (2, 3, 32), generator=g, dtype=torch.int16)
    full = decode_rotated(trellis, 2, "mul1")
    assert full.shape == (32, 48)
    for ti in range(2):
        for to in range(3):
            one = decode_rotated(trellis[ti : ti + 1, to : to + 1].clone(), 2, "mul1")
            assert torch.equal(full[16 * ti : 16 * ti + 16, 16 * to : 16 * to + 16], one)


def test_hadamard_is_sylvester_natural_order():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(7):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    i = torch.arange(128)
    popcount = sum(((i.view(-1, 1) & i.view(1, -1)) >> b) & 1 for b in range(7))
    assert torch.equal(h, (1 - 2 * (popcount % 2)).double())
    assert torch.allclose(hadamard_128().double(), h / math.sqrt(128), atol=1e-7)


def test_dequantize_original_basis():
    """W (in, out) = diag(suh) . H . W_rot . H . diag(svh), 128-blockwise; dequantize returns W^T."""
    g = torch.Generator().manual_seed(3)
    trellis = torch.randint(-(1 << 15), 1 << 15, (16, 8, 48), generator=g, dtype=torch.int16)  # in 256, out 128
    suh = (torch.rand(256, generator=g) + 0.5).half()
    svh = -(torch.rand(128, generator=g) + 0.5).half()
    q = EXL3Linear(trellis, suh, svh, "mul1", 3)
    w_rot = decode_rotated(trellis, 3, "mul1").double()
    h = hadamard_128().double()
    h_in = torch.block_diag(h, h)
    expected = torch.diag(suh.double()) @ h_in @ w_rot @ h @ torch.diag(svh.double())
    got = dequantize(q)
    assert got.shape == (128, 256) and got.dtype == torch.float32
    assert torch.allclose(got.double(), expected.T, rtol=1e-5, atol=1e-5)
