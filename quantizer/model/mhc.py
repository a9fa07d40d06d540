"""Manifold-constrained hyper-connections (mHC): n = hc_mult residual streams per token.

At each site (attention, FFN) the streams give three mixes through one small projection of their
RMS-normalised concatenation: `pre` (collapse n streams to the sublayer input), `post` (spread the
sublayer output back) and `comb` (a Sinkhorn-projected, doubly stochastic stream mixer):
    streams' = post * y + comb^T @ streams
V4 collapses each site's input with that site's own `pre` and ends with a learned `hc_head`.
V4.1 delays the collapse by one site (see block.py) and ends with the last FFN site's `pre`.
All of it runs in float32, like the F32 `hc_*` tensors it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.linear import rms_normalize


@dataclass
class HcMix:
    pre: torch.Tensor  # [B, S, n]
    post: torch.Tensor  # [B, S, n]
    comb: torch.Tensor  # [B, S, n, n]


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           cfg: ModelConfig) -> HcMix:
    n = cfg.hc_mult
    eps = cfg.hc_eps
    flat = rms_normalize(streams.flatten(2), cfg.rms_norm_eps)
    with torch.autocast(streams.device.type, enabled=False):  # float32 even inside bf16 autocast (training)
        mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return HcMix(pre, post, comb)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[B, S, n, D] x [B, S, n] -> [B, S, D]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=2)


def hc_expand(streams: torch.Tensor, y: torch.Tensor, mix: HcMix) -> torch.Tensor:
    """New streams from the old ones and the sublayer output y [B, S, D]."""
    return mix.post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(mix.comb.transpose(-1, -2), streams)


def hc_head_collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     cfg: ModelConfig) -> torch.Tensor:
    """V4's final learned collapse (`hc_head_fn/base/scale`)."""
    flat = rms_normalize(streams.flatten(2), cfg.rms_norm_eps)
    with torch.autocast(streams.device.type, enabled=False):
        pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + cfg.hc_eps
    return hc_collapse(streams, pre)
