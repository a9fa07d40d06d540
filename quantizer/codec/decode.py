"""Pure-torch EXL3 decode (CPU or CUDA), bit-exact with exllamav3's `reconstruct` in the rotated basis."""

from __future__ import annotations

import torch

from quantizer.exl3 import Codebook, codebook_values

from .hadamard import rotate_cols, rotate_rows
from .packed import EXL3Linear
from .trellis import tiles_to_matrix, unpack_trellis


def decode_rotated(trellis: torch.Tensor, K: float, codebook: Codebook | str) -> torch.Tensor:
    """fp16 (in, out) weight in the rotated basis, exactly as exllamav3's `reconstruct` writes it."""
    states = unpack_trellis(trellis, K)
    values = codebook_values(codebook, trellis.device)[states.long()]
    return tiles_to_matrix(values)


def dequantize(q: EXL3Linear) -> torch.Tensor:
    """float32 (out, in) weight in the original basis and HF orientation: (diag(suh) H W_rot H diag(svh))^T."""
    w = rotate_rows(decode_rotated(q.trellis, q.K, q.codebook).float())
    w *= q.suh.float().unsqueeze(1)
    w = rotate_cols(w)
    w *= q.svh.float().unsqueeze(0)
    return w.t().contiguous()
