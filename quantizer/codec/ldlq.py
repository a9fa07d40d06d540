"""Hessian preparation and LDLQ: GPTQ-style error feedback over 16-row strips of the rotated weight.

With H = (I + L) D (I + L)^T, L strictly block-lower (16x16 blocks, zero diagonal blocks), quantizing the
(in, out) weight strip by strip from the last input row up, each strip aimed at
W[strip] + L[later, strip]^T (W - Q)[later], leaves a proxy error tr(E^T H E) made of D-weighted
per-strip errors only (docs/exl3-format.md, how exllamav3 quantizes one linear, step 3).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from quantizer.exl3 import Codebook, codebook_values

from .trellis import TILE, matrix_to_tiles, tiles_to_matrix
from .viterbi import EncoderMode, encode_tiles

SIGMA_REG = 0.025  # damping, as a share of the mean diagonal
_CHOLESKY_RETRIES = 10


def finalize_hessian(hessian: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """H / count plus SIGMA_REG * mean(diag) on the diagonal; None when there is no usable H (plain MSE)."""
    if hessian is None or count == 0:
        return None
    h = hessian.to(torch.float32) / count
    diag_mean = h.diagonal().mean().item()
    if not torch.isfinite(h).all() or not diag_mean >= 1e-20:
        warnings.warn("Hessian is non-finite or has a vanishing diagonal; quantizing with plain MSE instead",
                      stacklevel=3)
        return None
    h.diagonal().add_(SIGMA_REG * diag_mean)
    return h


def block_ldl(h: torch.Tensor, block: int = TILE) -> torch.Tensor:
    """L with zero diagonal blocks such that h = (I + L) D (I + L)^T for a block-diagonal D.

    A Cholesky failure is retried with more damping (2 * SIGMA_REG * mean(diag) each time), as exllamav3 does.
    """
    n = h.shape[0]
    h = h.clone()
    for _ in range(_CHOLESKY_RETRIES + 1):
        chol, info = torch.linalg.cholesky_ex(h)
        if info.item() == 0:
            break
        h.diagonal().add_(2 * SIGMA_REG * h.diagonal().mean())
    else:
        raise ValueError(f"Hessian is not positive definite even after {_CHOLESKY_RETRIES} damping retries")
    m = n // block
    diag_blocks = chol.view(m, block, m, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    unit = (chol.view(n, m, block).transpose(0, 1) @ torch.linalg.inv(diag_blocks)).transpose(0, 1)
    lower = unit.reshape(n, n)
    idx = torch.arange(m, device=h.device)
    lower.view(m, block, m, block)[idx, :, idx, :] = 0.0
    return lower


def ldlq(
    weights: torch.Tensor,
    lowers: Sequence[torch.Tensor | None],
    K: float,
    codebook: Codebook,
    mode: EncoderMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rotated (in, out) weights, stacked (B, in, out), each with its L (None: no Hessian).

    Returns the reconstructions (B, in, out) and the states (B, in/16, out/16, 256). Strip i of every
    matrix goes to the encoder in one call (a strip alone is only out/16 tiles); each matrix's feedback
    is its own matmul, so a matrix gets the same result in a batch as alone. Without any L every tile is
    quantized on its own, all in one call.
    """
    b, k, n = weights.shape
    values = codebook_values(codebook, weights.device).float()
    if all(lower is None for lower in lowers):
        states = encode_tiles(matrix_to_tiles(weights.reshape(b * k, n)).flatten(0, 1), K, codebook, mode)
        states = states.view(b, k // TILE, n // TILE, -1)
        return tiles_to_matrix(values[states.flatten(0, 1).long()]).view(b, k, n), states
    err = torch.zeros_like(weights)  # W - Q of the strips done so far (rows below the current strip)
    states = torch.empty(b, k // TILE, n // TILE, TILE * TILE, dtype=torch.int32, device=weights.device)
    for i in range(k - TILE, -1, -TILE):
        j = i + TILE
        target = weights[:, i:j].clone()
        for m, lower in enumerate(lowers):
            if lower is not None:
                target[m] += lower[j:, i:j].T @ err[m, j:]
        s = encode_tiles(matrix_to_tiles(target.reshape(b * TILE, n)).flatten(0, 1), K, codebook, mode)
        states[:, i // TILE] = s.view(b, n // TILE, -1)
        err[:, i:j] = weights[:, i:j] - tiles_to_matrix(values[s.long()].view(b, n // TILE, -1)).view(b, TILE, n)
    return tiles_to_matrix(values[states.flatten(0, 1).long()]).view(b, k, n), states
