"""CPU linear quantizer: exllamav3's `quantize_exl3` algorithm (docs/exl3-format.md) on top of our own encoder.

Steps: finalize H (average, damp), random input/output signs, 128-block Hadamard on both sides with
channel-scale regularisation, a global-scale search on sampled tiles, LDLQ, a refit of the per-channel
scales in the H metric, then packing. Weights come in HF orientation (out, in); the EXL3 result is in
exllamav3's (in, out) orientation.

Small matrices cost little each but many encoder calls, so same-shape matrices at one K go through the
encoder together (quantize_linears): one global-scale search on a sample pooled over the batch, and one
encoder call per LDLQ strip for all of them. Everything else is per matrix; quantize_linear is the batch
of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from quantizer.exl3 import Codebook, parse_codebook, trellis_k

from .decode import dequantize
from .hadamard import BLOCK, rotate_cols, rotate_rows
from .ldlq import block_ldl, finalize_hessian, ldlq
from .packed import EXL3Linear
from .scale import global_scale
from .trellis import pack_trellis
from .viterbi import ENCODER_MODES, EncoderMode

CODEBOOK_SCALE = 1.24371088  # std of the 3INST/mcg codebooks; exllamav3 normalises every weight to it
_REFIT_ROUNDS = 2


def _random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(torch.float32)


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim).sqrt()


def _regularize(w: torch.Tensor, su: torch.Tensor, sv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold channel scales into su/sv and rotate both sides: w (in, out) -> (w_rot, su, sv), w = su H w_rot H sv."""
    out_scales = _rms(w, 0)
    mean = out_scales.mean()
    if mean > 1e-30:
        out_scales = out_scales / mean
    dead = out_scales < 1e-30  # all-zero output channels decode to exactly zero
    sv = sv * torch.where(dead, torch.full_like(out_scales, 0.1), out_scales) + 1e-10
    w = rotate_cols(w / sv)
    sv = torch.where(dead, torch.zeros_like(sv), sv)
    in_scales = _rms(w, 1)
    in_scales = torch.where(in_scales < 1e-30, torch.full_like(in_scales, 0.1), in_scales)
    su = su * in_scales / -CODEBOOK_SCALE + 1e-10
    return rotate_rows(w / su.unsqueeze(1)), su, sv


def _refit_scales(w: torch.Tensor, recon: torch.Tensor, h: torch.Tensor, su: torch.Tensor,
                  sv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Refit su (in) and sv (out) to the quantized weight in the H metric, trellis fixed (exllamav3's
    "free polish"): closed-form output scales, then a linear solve for the input scales, twice."""
    hw = h @ w
    for _ in range(_REFIT_ROUNDS):
        num = (recon * hw).sum(0)
        den = (recon * (h @ recon)).sum(0)
        c = torch.where(den > 1e-30, num / den.clamp(min=1e-30), torch.ones_like(num))
        recon, sv = recon * c, sv * c
        a = (recon @ recon.T) * h
        a.diagonal().add_(1e-6 * a.diagonal().mean())
        r, info = torch.linalg.solve_ex(a, (recon * hw).sum(1))
        if info.item() != 0:  # singular (e.g. an all-zero weight): keep the input scales
            r = torch.ones_like(r)
        r = torch.where(torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
        recon, su = recon * r.unsqueeze(1), su * r
    return su, sv


def _proxy_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor | None) -> float:
    """tr(E H E^T) / tr(W H W^T) for (out, in) weights; relative MSE without H."""
    e = w - w_hat
    if h is None:
        return float(e.square().sum() / w.square().sum().clamp(min=1e-30))
    return float(((e @ h) * e).sum() / ((w @ h) * w).sum().clamp(min=1e-30))


def check_linear_inputs(weight: torch.Tensor, hessian: torch.Tensor | None = None, count: int = 1) -> None:
    """Clear ValueErrors for what no EXL3 quantizer (ours or exllamav3) accepts."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if in_f % BLOCK or out_f % BLOCK:
        raise ValueError(f"weight (out={out_f}, in={in_f}): EXL3 needs both dimensions to be multiples of {BLOCK}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight contains NaN or inf")
    if hessian is not None and tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(f"Hessian must be ({in_f}, {in_f}) for a weight with in={in_f}, got {tuple(hessian.shape)}")
    if count < 0:
        raise ValueError(f"Hessian count must be >= 0, got {count}")


@dataclass
class _Prepared:
    """One matrix between the per-matrix preparation and the batched encoding."""

    weight: torch.Tensor  # (out, in) float32, as given
    h: torch.Tensor | None  # finalized (averaged, damped) Hessian; None: plain MSE
    h_raw: torch.Tensor | None  # averaged, undamped: the metric proxy_err reports
    lower: torch.Tensor | None  # block-LDL factor of the rotated H
    w_rot: torch.Tensor  # (in, out) rotated and regularised: weight^T = su H w_rot H sv
    su: torch.Tensor
    sv: torch.Tensor


def _prepare(weight: torch.Tensor, h: torch.Tensor | None, h_raw: torch.Tensor | None, seed: int) -> _Prepared:
    """Signs from `seed`, the rotated H and its LDL factor, and the regularised rotated weight."""
    w32 = weight.detach().to(torch.float32)
    w = w32.T.contiguous()  # (in, out)
    k, n = w.shape
    gen = torch.Generator().manual_seed(seed)
    su, sv = _random_signs(k, gen).to(w.device), _random_signs(n, gen).to(w.device)
    lower = None
    if h is not None:
        h_rot = rotate_rows(rotate_cols(h * su.unsqueeze(0)) * su.unsqueeze(1))
        lower = block_ldl(h_rot)
    w_rot, su, sv = _regularize(w, su, sv)
    return _Prepared(w32, h, h_raw, lower, w_rot, su, sv)


def _finish(p: _Prepared, recon_rot: torch.Tensor, states: torch.Tensor, K: float, codebook: Codebook) -> EXL3Linear:
    """Refit the channel scales to the quantized weight (with H), pack, and measure the proxy error."""
    su, sv = p.su, p.sv
    if p.h is not None:
        recon = rotate_cols(rotate_rows(recon_rot) * su.unsqueeze(1)) * sv
        su, sv = _refit_scales(p.weight.T, recon, p.h, su, sv)
    q = EXL3Linear(pack_trellis(states, K), su.half(), sv.half(), codebook, K)
    return replace(q, proxy_err=_proxy_error(p.weight, dequantize(q), p.h_raw))


def _hessian_list(hessians, count: int) -> list[tuple[torch.Tensor | None, int]]:
    """(H, count) per matrix from None, one shared (H, count) pair, or a sequence of pairs / None."""
    if hessians is None:
        return [(None, 1)] * count
    if isinstance(hessians, tuple) and len(hessians) == 2 and isinstance(hessians[0], torch.Tensor):
        return [hessians] * count
    pairs = [(None, 1) if h is None else tuple(h) for h in hessians]
    if len(pairs) != count or any(len(h) != 2 for h in pairs):
        raise ValueError(f"hessians: give None, one (H, count) pair, or {count} (H, count) pairs / None")
    return pairs


def quantize_linears(
    weights: Sequence[torch.Tensor],
    K: float,
    hessians: tuple[torch.Tensor, int] | Sequence[tuple[torch.Tensor, int] | None] | None = None,
    *,
    codebook: Codebook | str = Codebook.MUL1,
    mode: EncoderMode = "fast",
    seeds: int | Sequence[int] = 0,
) -> list[EXL3Linear]:
    """Quantize same-shape HF weights (out, in) to EXL3 at K bits per weight, as a batch.

    hessians: None (plain MSE for all), one (H, count) pair shared by all (e.g. every expert's gate/up),
    or one (H, count) pair or None per weight; H is the (in, in) sum of x^T x over `count` input rows.
    seeds: one per weight, or an int s meaning s, s+1, ... (the random signs). Each result is what
    quantize_linear gives for that weight, seed and Hessian, except that the global scale is searched
    once for the whole batch (on a pooled sample, see scale.py).
    """
    cb = parse_codebook(codebook)
    k_bits = trellis_k(K, cb)
    if mode not in ENCODER_MODES:
        raise ValueError(f"unknown encoder mode {mode!r}; use one of {', '.join(ENCODER_MODES)}")
    weights = list(weights)
    if not weights:
        raise ValueError("quantize_linears needs at least one weight")
    seed_list = [seeds + i for i in range(len(weights))] if isinstance(seeds, int) else list(seeds)
    if len(seed_list) != len(weights):
        raise ValueError(f"{len(weights)} weights need {len(weights)} seeds, got {len(seed_list)}")
    pairs = _hessian_list(hessians, len(weights))
    for w, (h, c) in zip(weights, pairs):
        check_linear_inputs(w, h, c)
        if w.shape != weights[0].shape:
            raise ValueError(f"quantize_linears needs same-shape weights, got {tuple(weights[0].shape)} and "
                             f"{tuple(w.shape)}")

    finalized = {}  # a shared Hessian is finalized once
    for h, c in pairs:
        if (id(h), c) not in finalized:
            damped = finalize_hessian(h, c)
            finalized[id(h), c] = (damped, None if damped is None else h.to(torch.float32) / c)
    prepared = [_prepare(w, *finalized[id(h), c], s) for w, (h, c), s in zip(weights, pairs, seed_list)]
    g = global_scale([p.w_rot for p in prepared], k_bits, cb)
    for p in prepared:
        p.w_rot, p.su = p.w_rot * g, p.su / g
    recon, states = ldlq(torch.stack([p.w_rot for p in prepared]), [p.lower for p in prepared], k_bits, cb, mode)
    return [_finish(p, r, s, k_bits, cb) for p, r, s in zip(prepared, recon, states)]


def quantize_linear(
    weight: torch.Tensor,
    K: float,
    hessian: torch.Tensor | None = None,
    count: int = 1,
    *,
    codebook: Codebook | str = Codebook.MUL1,
    mode: EncoderMode = "fast",
    seed: int = 0,
) -> EXL3Linear:
    """Quantize an HF-orientation weight (out, in) to EXL3 at K bits per weight.

    hessian: (in, in) sum of x^T x over `count` input rows (count=1: already averaged); None or count=0
    quantizes with plain MSE and proxy_err is then the relative MSE. Otherwise proxy_err is
    tr(E H E^T) / tr(W H W^T) of the stored (fp16-scaled) result against the undamped H.
    """
    return quantize_linears([weight], K, [(hessian, count)], codebook=codebook, mode=mode, seeds=[seed])[0]
