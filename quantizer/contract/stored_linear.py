"""A linear as a pack stores it and its loader reads it: the unit the loader profiles' rules, the pack
spec and the quantize stage share (docs/exl3-format.md, stored tensors)."""

from __future__ import annotations

from typing import NamedTuple

from quantizer.model.targets import Target


class StoredLinear(NamedTuple):
    """One linear as the pack stores it and its loader reads it, and where its weight comes from.
    (Named tuples: the full model has ~96k linears and ~190k pack tensors, built per plan a search tries.)"""

    key: str  # stored key: the target key, or `<wo_a key>.slice.<g>`
    target: Target
    K: float | None  # None: native storage; 16: an unquantized fp16 weight
    codebook: str | None  # None unless quantized (K not None and not 16)
    rows: tuple[int, int] | None = None  # row range of the native [out, in] weight; None = all of it

    @property
    def in_features(self) -> int:
        return self.target.in_features

    @property
    def out_features(self) -> int:
        return self.rows[1] - self.rows[0] if self.rows else self.target.out_features

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features
