"""Global-scale search: the factor g the rotated weights are multiplied by before LDLQ (docs/exl3-format.md, how exllamav3
quantizes one linear, step 2).

exllamav3 test-quantizes sampled tiles (a wrapped diagonal three tiles wide, plus the tiles of extreme
RMS where outlier channels show) at g on a coarse grid 0.1..1.9, then on a fine grid around the best,
refined by a parabola. Its sample grows with the matrix: for a 128x128 matrix it encodes about 5x the
matrix's own tiles. Here the sample is bounded, max(16, tiles / 8) and at most SAMPLE_CAP tiles drawn
from the same diagonal and extremes, and pooled over a batch of same-shape matrices (one g for all of
them: after the Hadamard rotation and the channel-scale regularisation their distributions are alike).
The coarse grid runs on a quarter of the sample, and every test uses the fast encoder, whose error curve
has the same minimum as the exact one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from quantizer.exl3 import Codebook, codebook_values

from .trellis import matrix_to_tiles
from .viterbi import encode_tiles

# LDLQ feedback inflates the tiles the encoder sees; the search runs on the weight before feedback, so
# its samples are inflated by the expected drift (exllamav3's measured LDLQ_DRIFT).
LDLQ_DRIFT = {1: 1.08, 1.5: 1.035, 2: 1.018, 2.5: 1.009, 3: 1.004}
SAMPLE_MIN, SAMPLE_CAP = 16, 64
COARSE_SCALES = tuple(0.1 + 0.2 * i for i in range(10))
FINE_STEP = 0.075
_COARSE_SHARE = 4  # the coarse grid sees every 4th sample tile
_DIAGONAL_WIDTH = 3


def sample_budget(tiles: int) -> int:
    """Sample tiles for a search over `tiles` tiles in all: max(16, tiles / 8), at most SAMPLE_CAP."""
    return min(tiles, max(SAMPLE_MIN, tiles // 8), SAMPLE_CAP)


def _spread(n: int, count: int, device: torch.device) -> torch.Tensor:
    """`count` indices spread evenly over range(n)."""
    return torch.div(torch.arange(count, device=device) * n, count, rounding_mode="floor")


def sample_tiles(w: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` tiles (count, 256) of the rotated weight w and the share of the matrix each stands for.

    A stratified sample of the squared error over the whole matrix: the quarter of highest RMS (where
    outlier channels show, and which decide the best scale) is always in, each tile for itself; the rest
    is spread evenly along a wrapped diagonal three tiles wide that crosses every tile row and column, each
    tile standing for its share of the remaining tiles.
    """
    tiles = matrix_to_tiles(w)
    tk, tn = tiles.shape[:2]
    flat = tiles.flatten(0, 1)
    total = flat.shape[0]
    count = min(count, total)
    top = flat.square().mean(1).topk(count // 4).indices
    rest = torch.ones(total, dtype=torch.bool, device=w.device)
    rest[top] = False
    length = max(tk, tn)
    d = _spread(_DIAGONAL_WIDTH * length, 4 * count, w.device)  # oversample, drop the top tiles, keep the first
    i, j = d // _DIAGONAL_WIDTH, d % _DIAGONAL_WIDTH
    diagonal = ((i % tk) * tn + (i + j) % tn).unique()
    diagonal = diagonal[rest[diagonal]]
    diagonal = diagonal[_spread(diagonal.numel(), min(count - top.numel(), diagonal.numel()), w.device)]
    shares = torch.cat((torch.full((top.numel(),), 1.0 / total, device=w.device),
                        torch.full((diagonal.numel(),), (total - top.numel()) / max(diagonal.numel(), 1) / total,
                                   device=w.device)))
    return flat[torch.cat((top, diagonal))], shares


def _sample_mse(samples: torch.Tensor, shares: torch.Tensor, scales: list[float], K: float,
                codebook: Codebook) -> torch.Tensor:
    """For each scale s, the mean squared error of quantizing samples * s (measured back at the samples'
    scale), each sample counted by its share of the matrix."""
    scale = torch.tensor(scales, dtype=samples.dtype, device=samples.device).view(-1, 1, 1)
    batch = (samples.unsqueeze(0) * scale).flatten(0, 1)
    states = encode_tiles(batch, K, codebook, "fast")
    recon = codebook_values(codebook, samples.device).float()[states.long()].view(len(scales), *samples.shape)
    return ((recon / scale - samples.unsqueeze(0)).square().mean(2) * shares).sum(1) / shares.sum()


def global_scale(weights: Sequence[torch.Tensor], K: float, codebook: Codebook) -> float:
    """One g for rotated (in, out) weights of one shape: coarse grid on a quarter of the pooled sample,
    then a 5-point fine grid around the best on all of it, refined by a parabola through the minimum."""
    total = sum(w.numel() for w in weights) // 256
    per_matrix = math.ceil(sample_budget(total) / len(weights))
    picked = [sample_tiles(w, per_matrix) for w in weights]
    samples = torch.cat([t for t, _ in picked]) * LDLQ_DRIFT.get(K, 1.0)
    shares = torch.cat([s for _, s in picked])
    coarse = _sample_mse(samples[::_COARSE_SHARE], shares[::_COARSE_SHARE], list(COARSE_SCALES), K, codebook)
    center = COARSE_SCALES[int(coarse.argmin())]
    fine = [center + FINE_STEP * (i - 2) for i in range(5)]
    err = _sample_mse(samples, shares, fine, K, codebook).tolist()
    best = min(range(5), key=err.__getitem__)
    offset = 0.0
    if 0 < best < 4:
        y0, y1, y2 = err[best - 1 : best + 2]
        denom = y0 - 2.0 * y1 + y2
        offset = max(-0.5, min(0.5, 0.5 * (y0 - y2) / denom)) if denom > 0 else 0.0
    return max(fine[best] + offset * FINE_STEP, 0.01)
