"""An EXL3 linear as fixed codes times two free scale vectors, the form tuning differentiates through.

exllamav3 computes W = diag(suh) H Q H diag(svh) in its (in, out) orientation (docs/exl3-format.md), so the
HF-orientation weight our forward uses is svh[:, None] * M * suh[None, :] with M = (H Q H)^T fixed by the
trellis. Tuning moves only suh and svh; M is decoded once per linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantizer.codec import EXL3Linear, decode_rotated
from quantizer.codec.hadamard import rotate_cols, rotate_rows


@dataclass(frozen=True)
class FactoredLinear:
    """M [out, in] float32 (the rotated codes, unscaled) and the stored fp16 suh [in] / svh [out]."""

    codes: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor

    def weight(self, suh: torch.Tensor | None = None, svh: torch.Tensor | None = None) -> torch.Tensor:
        """The HF-orientation weight with these scale vectors (default: the stored ones), float32."""
        suh = self.suh.float() if suh is None else suh
        svh = self.svh.float() if svh is None else svh
        return svh.unsqueeze(1) * self.codes * suh.unsqueeze(0)


def factor(q: EXL3Linear) -> FactoredLinear:
    """Split a stored linear into its fixed codes and its scale vectors; `weight()` equals `dequantize(q)`
    up to float32 rounding (the scales are applied after the rotations rather than between them)."""
    codes = rotate_cols(rotate_rows(decode_rotated(q.trellis, q.K, q.codebook).float()))
    return FactoredLinear(codes.t().contiguous(), q.suh, q.svh)
