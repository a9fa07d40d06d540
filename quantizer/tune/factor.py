"""An EXL3 linear as fixed codes times two free scale vectors, the form tuning differentiates through.

exllamav3 computes W = diag(suh) H Q H diag(svh) in its (in, out) orientation (docs/exl3-format.md), so the
HF-orientation weight our forward uses is svh[:, None] * M * suh[None, :] with M = (H Q H)^T fixed by the
trellis. Tuning moves only suh and svh; M is decoded once per linear, on the device the trellis is on.
"""

from __future__ import annotations

import torch

from quantizer.codec import EXL3Linear, decode_rotated
from quantizer.codec.hadamard import rotate_cols, rotate_rows
from quantizer.model.hooks import ScaledCodes


def factor(q: EXL3Linear) -> ScaledCodes:
    """Split a stored linear into its fixed codes M [out, in] (float32) and its stored fp16 scale vectors;
    `.weight()` equals `dequantize(q)` up to float32 rounding (the scales are applied after the rotations
    rather than between them)."""
    codes = rotate_cols(rotate_rows(decode_rotated(q.trellis, q.K, q.codebook).float()))
    return ScaledCodes(codes.t().contiguous(), q.suh, q.svh)


def unit_scaled(weight: torch.Tensor) -> ScaledCodes:
    """A weight stored as it is (fp16, K 16) in the same form, with unit scales that are never tuned."""
    w = weight.float()
    return ScaledCodes(w, torch.ones(w.shape[1], device=w.device), torch.ones(w.shape[0], device=w.device))
