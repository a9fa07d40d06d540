"""Encoding one work unit: K 16 linears are cast to fp16, the rest go to our CPU codec or to exllamav3
(its own conversion, or with encoder "ours" our batch loop and tile-search kernel around its steps).

Both encoders get deterministic seeds (CPU: per stored key; GPU: per unit, offset by the member's index
as exllamav3's batch takes them) and each linear's Hessian when the caller has one (uncalibrated
otherwise), and return exactly the tensors exllamav3 stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantizer.codec import EXL3Linear, quantize_linear
from quantizer.contract.stored_linear import StoredLinear
from quantizer.exl3 import UNQUANTIZED
from quantizer.quantize.linears import tensor_seed
from quantizer.quantize.settings import QuantizeSettings


@dataclass(frozen=True)
class EncodedUnit:
    tensors: dict[str, torch.Tensor]  # stored tensor name -> data, for every linear of the unit
    proxy_err: dict[str, float | None]  # stored key -> tr(E H E^T)/tr(W H W^T) (relative MSE uncalibrated)


def encode_unit(
    name: str,
    members: list[StoredLinear],
    weights: list[torch.Tensor],
    hessians: list,
    codebook: str,
    settings: QuantizeSettings,
) -> EncodedUnit:
    """`weights` are [out, in] in source orientation, on the encoding device."""
    if members[0].K == UNQUANTIZED:
        (s,), (w,) = members, weights
        return EncodedUnit({f"{s.key}.weight": w.to(device="cpu", dtype=torch.float16)}, {s.key: None})
    if settings.device == "cuda":
        linears = _encode_cuda(name, members, weights, hessians, codebook, settings)
    else:
        linears = [
            quantize_linear(w, s.K, *_hessian_args(h), codebook=codebook, mode=settings.encoder,
                            seed=tensor_seed(settings.seed, s.key))
            for s, w, h in zip(members, weights, hessians)
        ]
    tensors: dict[str, torch.Tensor] = {}
    for s, q in zip(members, linears):
        tensors.update(q.tensors(s.key))
    return EncodedUnit(tensors, {s.key: q.proxy_err for s, q in zip(members, linears)})


def _hessian_args(h) -> tuple:
    return (None,) if h is None else (h[0], h[1])


def _encode_cuda(name, members, weights, hessians, codebook, settings: QuantizeSettings) -> list[EXL3Linear]:
    """One exllamav3 batch, its tile search by `settings.encoder`; a Hessian the provider returned as one
    object for every member is shared (exllamav3 then runs a single LDLQ over the concatenated weights)."""
    from quantizer.codec.exllamav3_adapter import quantize_batch

    if all(h is None for h in hessians):
        hs, counts = None, 1
    elif all(h is hessians[0] for h in hessians):
        hs, counts = hessians[0]
    else:
        hs = [None if h is None else h[0] for h in hessians]
        counts = [0 if h is None else h[1] for h in hessians]
    return quantize_batch(weights, members[0].K, hs, counts=counts, codebook=codebook,
                          seed=tensor_seed(settings.seed, name), device=weights[0].device,
                          encoder=settings.encoder)
