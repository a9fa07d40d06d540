"""Partial interleaved (GPT-J) RoPE on the last `rope_dim` channels, two frequency tables.

Sliding-only layers rotate with `rope_theta` and no scaling ("main"); compressed layers (V4 CSA/HCA,
V4.1 ratio 1/2) use `compress_rope_theta` with YaRN from `rope_scaling` ("compress"). As in
DeepSeek's reference and transformers 5.23, YaRN's attention factor is NOT applied to cos/sin.
The attention output is de-rotated with the conjugate rotation (`-sin`) at the query position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantizer.checkpoint.config import ModelConfig


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN frequencies (truncated correction range, linear ramp between beta_fast and beta_slow)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def compress_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        return yarn_inv_freq(cfg.rope_dim, cfg.compress_rope_theta, scaling)
    return default_inv_freq(cfg.rope_dim, cfg.compress_rope_theta)


@dataclass
class RopeTable:
    """cos/sin [positions, rope_dim/2] in float32 for positions 0..n-1."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, inv_freq: torch.Tensor, length: int, device) -> RopeTable:
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq.to(device)[None, :]
        return cls(freqs.cos(), freqs.sin())

    def at(self, positions: torch.Tensor) -> RopeTable:
        return RopeTable(self.cos[positions], self.sin[positions])


@dataclass
class RopeTables:
    main: RopeTable
    compress: RopeTable

    @classmethod
    def build(cls, cfg: ModelConfig, length: int, device) -> RopeTables:
        return cls(
            RopeTable.build(default_inv_freq(cfg.rope_dim, cfg.rope_theta), length, device),
            RopeTable.build(compress_inv_freq(cfg), length, device),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x pairwise (2i, 2i+1); cos/sin must
    broadcast against x[..., 0::2] of that slice. Pass -sin to de-rotate."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
