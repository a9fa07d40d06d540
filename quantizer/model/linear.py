"""The two leaf modules every block is made of: a linear named by its native weight, and RMSNorm.

Weights are held dequantized ([out, in], like the checkpoint); a linear computes in its weight's
dtype and consults the forward hooks (input observation, weight override) under its native name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantizer.model.hooks import ForwardHooks


class NativeLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, name: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.native_name = name

    def resolved_weight(self, x: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """Report the input and return the weight to use for this call."""
        weight = self.weight
        if hooks is not None:
            if hooks.linear_input is not None:
                hooks.linear_input(self.native_name, x.detach())
            if hooks.weight_override is not None:
                replacement = hooks.weight_override(self.native_name, weight)
                if replacement is not None:
                    weight = replacement.to(device=weight.device, dtype=weight.dtype)
        return weight

    def forward(self, x: torch.Tensor, hooks: ForwardHooks | None = None) -> torch.Tensor:
        weight = self.resolved_weight(x, hooks)
        return F.linear(x.to(weight.dtype), weight)

    def grouped(self, x: torch.Tensor, hooks: ForwardHooks | None = None) -> torch.Tensor:
        """Block-diagonal use: x [..., G, in] times row block g of the weight -> [..., G, out/G]."""
        weight = self.resolved_weight(x, hooks)
        groups = x.shape[-2]
        w = weight.view(groups, -1, weight.shape[-1])
        lead = x.shape[:-2]
        xg = x.to(weight.dtype).reshape(-1, groups, x.shape[-1]).transpose(0, 1)  # [G, N, in]
        y = torch.bmm(xg, w.transpose(1, 2)).transpose(0, 1)  # [N, G, out/G]
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
