"""Trellis encoder: valid tail-biting rings, exact pack/unpack/decode round trips, and distortion against
exllamav3's measured numbers (docs/exl3-format.md, distortion: relative MSE on i.i.d. N(0,1) tiles)."""

import pytest
import torch

from quantizer.codec import decode_rotated, encode_tiles, pack_trellis, unpack_trellis
from quantizer.codec.trellis import step_bits, tiles_to_matrix
from quantizer.errors import UserError
from quantizer.exl3 import codebook_values

CASES = [("mul1", k) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)] + [
    (cb, k) for cb in ("mcg", "3inst") for k in range(1, 9)
]
# exllamav3 1.6.5 quantize_tiles on an H200 (docs/exl3-format.md, distortion)
REFERENCE_MSE = {("mul1", 1): 0.277, ("mul1", 2): 0.068, ("mul1", 4): 0.0046, ("mcg", 2): 0.074}


def _gaussian_tiles(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


def _relative_mse(tiles, states, codebook) -> float:
    recon = codebook_values(codebook).float()[states.long()]
    return ((recon - tiles).square().sum() / tiles.square().sum()).item()


@pytest.mark.parametrize("codebook,K", CASES)
def test_round_trip_is_exact(codebook, K):
    tiles = _gaussian_tiles(2, seed=int(K * 2))
    states = encode_tiles(tiles, K, codebook, mode="fast")
    assert states.dtype == torch.int32 and states.shape == (2, 256)
    # A ring: each state is the previous one shifted by D(p) bits plus its own new bits, 255 feeding 0.
    d = torch.tensor(step_bits(K))
    prev = states.roll(1, dims=1).long()
    assert torch.equal(((prev << d) | (states.long() & ((1 << d) - 1))) & 0xFFFF, states.long())
    trellis = pack_trellis(states.view(1, 2, 256), K)
    assert trellis.dtype == torch.int16 and trellis.shape == (1, 2, int(16 * K))
    assert torch.equal(unpack_trellis(trellis, K), states.view(1, 2, 256))
    values = codebook_values(codebook)[states.long()].view(1, 2, 256)
    assert torch.equal(decode_rotated(trellis, K, codebook), tiles_to_matrix(values))


@pytest.fixture(scope="module")
def encoded():
    """64 Gaussian tiles encoded in both modes, per reference case (exact mode dominates the test time)."""
    tiles = _gaussian_tiles(64, seed=2024)
    return tiles, {
        case: {mode: encode_tiles(tiles, case[1], case[0], mode=mode) for mode in ("exact", "fast")}
        for case in REFERENCE_MSE
    }


@pytest.mark.parametrize("case", list(REFERENCE_MSE))
def test_exact_mode_matches_exllamav3_distortion(encoded, case):
    tiles, states = encoded
    mse = _relative_mse(tiles, states[case]["exact"], case[0])
    assert mse == pytest.approx(REFERENCE_MSE[case], rel=0.02)


@pytest.mark.parametrize("case", list(REFERENCE_MSE))
def test_fast_mode_within_ten_percent_of_exact(encoded, case):
    tiles, states = encoded
    exact = _relative_mse(tiles, states[case]["exact"], case[0])
    fast = _relative_mse(tiles, states[case]["fast"], case[0])
    assert exact <= fast * 1.0001 and fast <= 1.10 * exact


def test_bad_input_is_refused():
    tiles = _gaussian_tiles(1, seed=0)
    with pytest.raises(UserError, match="not an EXL3 rate"):
        encode_tiles(tiles, 2.25)
    with pytest.raises(UserError, match="mul1"):
        encode_tiles(tiles, 2.5, "mcg")
    with pytest.raises(ValueError, match="encoder mode"):
        encode_tiles(tiles, 2, mode="slow")
    with pytest.raises(ValueError, match=r"\(N, 256\)"):
        encode_tiles(tiles[:, :128], 2)
    with pytest.raises(ValueError, match="NaN"):
        encode_tiles(tiles * float("nan"), 2)
