"""The two leaf modules every block is made of: a linear named by its native weight, and RMSNorm.

Weights are held dequantized ([out, in], like the checkpoint); a linear computes in its weight's
dtype and consults the forward hooks (input observation, scaled codes, weight override) under its
native name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantizer.model.hooks import ForwardHooks, ScaledCodes


class NativeLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, name: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.native_name = name

    def resolved(self, x: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor | ScaledCodes:
        """Report the input and return what to apply for this call: scaled codes, a replacement weight,
        or the model's own weight."""
        weight = self.weight
        if hooks is not None:
            if hooks.linear_input is not None:
                hooks.linear_input(self.native_name, x.detach())
            if hooks.scaled_codes is not None:
                scaled = hooks.scaled_codes(self.native_name)
                if scaled is not None:
                    return scaled
            if hooks.weight_override is not None:
                replacement = hooks.weight_override(self.native_name, weight)
                if replacement is not None:
                    weight = replacement.to(device=weight.device, dtype=weight.dtype)
        return weight

    def resolved_weight(self, x: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """`resolved` as one weight tensor (scaled codes built whole)."""
        w = self.resolved(x, hooks)
        return w.weight() if isinstance(w, ScaledCodes) else w

    def forward(self, x: torch.Tensor, hooks: ForwardHooks | None = None) -> torch.Tensor:
        w = self.resolved(x, hooks)
        if isinstance(w, ScaledCodes):
            return F.linear(x.to(w.codes.dtype) * w.suh, w.codes) * w.svh
        return F.linear(x.to(w.dtype), w)

    def grouped(self, x: torch.Tensor, hooks: ForwardHooks | None = None) -> torch.Tensor:
        """Block-diagonal use: x [..., G, in] times row block g of the weight -> [..., G, out/G]."""
        w = self.resolved(x, hooks)
        groups, lead = x.shape[-2], x.shape[:-2]
        scaled = isinstance(w, ScaledCodes)
        weight = w.codes if scaled else w
        xg = x.to(weight.dtype) * w.suh if scaled else x.to(weight.dtype)
        xg = xg.reshape(-1, groups, x.shape[-1]).transpose(0, 1)  # [G, N, in]
        y = torch.bmm(xg, weight.view(groups, -1, x.shape[-1]).transpose(1, 2)).transpose(0, 1)  # [N, G, out/G]
        if scaled:
            y = y * w.svh.view(groups, -1)
        return y.reshape(*lead, groups, -1)


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in float32; returns float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.float() * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dimension, in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
