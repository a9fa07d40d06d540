"""The stored form of one EXL3 linear (trellis, suh, svh, codebook marker) and its tensor-dict round trip."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from quantizer.exl3 import Codebook, k_from_trellis, parse_codebook, trellis_k

from .trellis import TILE, words_per_tile


def _as_int32(value: int) -> torch.Tensor:
    """The uint32 multiplier reinterpreted as an int32 scalar (safetensors has no uint32)."""
    return torch.tensor(value - (1 << 32) if value >= 1 << 31 else value, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class EXL3Linear:
    """One quantized linear in exllamav3's orientation: the weight is (in_features, out_features).

    trellis: int16 (in/16, out/16, 16*K); suh: fp16 (in,); svh: fp16 (out,). proxy_err is
    tr(E H E^T) / tr(W H W^T) (plain relative MSE without a Hessian) when this came from a quantizer, and
    None when it was read back from stored tensors.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: Codebook
    K: float
    proxy_err: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "codebook", parse_codebook(self.codebook))
        object.__setattr__(self, "K", trellis_k(self.K, self.codebook))
        t = self.trellis
        words = words_per_tile(self.K)
        if t.dtype != torch.int16 or t.dim() != 3 or t.shape[-1] != words:
            raise ValueError(f"trellis must be int16 (in/16, out/16, {words}) for K={self.K}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        for name, vec, size in (("suh", self.suh, self.in_features), ("svh", self.svh, self.out_features)):
            if vec.dtype != torch.float16 or tuple(vec.shape) != (size,):
                raise ValueError(f"{name} must be fp16 ({size},) to match the trellis, got {vec.dtype} {tuple(vec.shape)}")

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * TILE

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        """The tensors exllamav3 stores for this linear under `key`."""
        out = {f"{key}.trellis": self.trellis, f"{key}.suh": self.suh, f"{key}.svh": self.svh}
        if self.codebook.marker is not None:
            out[f"{key}.{self.codebook.value}"] = _as_int32(self.codebook.marker)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], key: str) -> EXL3Linear:
        """Parse `<key>.trellis/.suh/.svh` (+ `.mul1` or `.mcg`); K comes from the trellis shape."""
        missing = [f"{key}.{n}" for n in ("trellis", "suh", "svh") if f"{key}.{n}" not in tensors]
        if missing:
            raise ValueError(f"not EXL3 storage: {', '.join(missing)} missing")
        markers = [cb for cb in (Codebook.MUL1, Codebook.MCG) if f"{key}.{cb.value}" in tensors]
        if len(markers) > 1:
            raise ValueError(f"{key} carries both .mul1 and .mcg markers; a tensor has one codebook")
        trellis = tensors[f"{key}.trellis"]
        return cls(
            trellis=trellis,
            suh=tensors[f"{key}.suh"],
            svh=tensors[f"{key}.svh"],
            codebook=markers[0] if markers else Codebook.INST3,
            K=k_from_trellis(trellis.shape),
        )
