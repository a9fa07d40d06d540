"""exllamav3's batch conversion run step by step by us, with every Hessian and factor kept on the GPU.

exllamav3 1.6.5's `quantize_exl3_batch` moves each Hessian to the CPU once it is factored (and back for the
proxy error), and each factor once LDLQ has run: about 300 MB of pageable copies per expert of 5120 inputs,
2.5 s of a 15 s call on 16 experts (docs/encoder.md, "Where the time goes"). With our tile kernel those
copies are a quarter of the call. `quantize_exl3_batch_on_device` takes the same arguments and returns
the same results: it calls exllamav3's own steps (regularize, the batched scale search, LDLQ, the proxy
error, the scale refit, packing) in the same order with the same seeds, and factors each Hessian with the
same operations on the device, so the stored tensors are bit for bit the same (tests/gpu compares them).

It runs the common case only: one device, every Hessian dense, calibrated and not yet factored, and each
factorization succeeding. Anything else (an uncalibrated tensor, a degenerate or non-finite Hessian, a
failed Cholesky, several devices, scaled Hessians) goes to `quantize_exl3_batch` whole, before any input
was changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 16  # the LDL block: LDLQ quantizes 16 rows at a time
ORIGINAL_ON_HOST_ABOVE = 5e7  # weights: exllamav3 keeps a larger tensor's original for the refit on the CPU


@dataclass
class _Factored:
    """One Hessian as exllamav3's finalize leaves it, on the device."""
    H: torch.Tensor  # damped, sign-flipped and rotated (the proxy error and the refit read it)
    su: torch.Tensor  # the input sign flips, (in, 1)
    diag: torch.Tensor  # the damped diagonal before the rotation (regularize's input scales read it)


def _module():
    from exllamav3.modules.quant.exl3_lib import quantize

    return quantize


def _takes(h_datas: list[dict], quant_args: list[dict], device: torch.device) -> bool:
    """Whether every input is one this loop runs on `device` (see the module docstring)."""
    devices = quant_args[0]["devices"]
    if len(devices) != 1 or any(qa["devices"] != devices or qa.get("scaled_hessian") for qa in quant_args):
        return False
    return all(hd["H"].device == device and hd["H"].dtype == torch.float32 and not hd.get("packed")
               and not hd["finalized"] and "H_swap_device" not in hd and hd["count"] > 0 for hd in h_datas)


def _finalize(h_data: dict, quant_args: dict, L: torch.Tensor) -> _Factored | None:
    """exllamav3's `finalize_capture_H` on a copy of the Hessian: the mean over the calibration rows, damped
    by sigma_reg x its mean diagonal, sign-flipped by a seeded draw, rotated by the blockwise Hadamard; its
    block LDL factor written into `L`. None where exllamav3 would not factor it (a mean diagonal that is
    not finite or below 1e-20) or the Cholesky fails: the caller then hands the batch to exllamav3."""
    x = _module()
    H = h_data["H"] / h_data["count"]
    diag_mean = torch.diag(H).mean().item()
    if not math.isfinite(diag_mean) or diag_mean < 1e-20:
        return None
    H.diagonal().add_(quant_args.get("sigma_reg", 0.025) * diag_mean)
    diag = H.diagonal().clone()
    su = (torch.randn(H.shape[0], device=H.device).sign() + 1e-5).sign().to(torch.float).unsqueeze(1)
    H *= su.T
    x.blockwise_preapply_had_r_(H, x.had_k)
    H *= su
    x.blockwise_preapply_had_l_(H, x.had_k)
    try:
        L.copy_(torch.linalg.cholesky(H))
    except torch.linalg.LinAlgError:
        return None
    _unit_blocks(L)
    return _Factored(H, su, diag)


def _unit_blocks(L: torch.Tensor) -> None:
    """The Cholesky factor L (C-contiguous) made block-unit-lower in place, as exllamav3's `block_ldl`:
    each 16-column block times the inverse of its diagonal block (the same matmul per block), the diagonal
    blocks set to the identity, then the diagonal zeroed (what LDLQ expects)."""
    n = L.shape[0]
    m = n // BLOCK
    inv = torch.linalg.inv(torch.diagonal(L.view(m, BLOCK, m, BLOCK), dim1=0, dim2=2).permute(2, 0, 1))
    cols = L.view(n, m, BLOCK)
    for i in range(m):
        cols[:, i, :] = cols[:, i, :] @ inv[i, :, :]
    blocks = L.view(m, BLOCK, m, BLOCK).permute(0, 2, 1, 3)
    diagonal = torch.arange(m)
    blocks[diagonal, diagonal] = torch.stack([torch.eye(BLOCK, device=L.device, dtype=L.dtype)] * m)
    everything = torch.arange(n)
    L[everything, everything] = 0


def quantize_exl3_batch_on_device(weights: list[torch.Tensor], h_datas: list[dict],
                                  quant_args_list: list[dict]) -> list[tuple[float, dict]]:
    """`quantize_exl3_batch(weights, h_datas, quant_args_list)` with its Hessians and factors kept on the
    device: weights (in, out) fp32, one H_data per weight (the same dict for a shared Hessian); returns
    (proxy error, stored tensors) per weight and updates each quant_args as exllamav3 does."""
    x = _module()
    qa0 = quant_args_list[0]
    device = torch.device("cuda", qa0["devices"][0])
    if not _takes(h_datas, quant_args_list, device):
        return x.quantize_exl3_batch(weights, h_datas, quant_args_list)
    shared = all(hd is h_datas[0] for hd in h_datas)
    if not shared and len({tuple(w.shape) for w in weights}) != 1:
        raise ValueError("distinct Hessians need same-shape weights (exllamav3 stacks them)")
    n_in = weights[0].shape[0]
    Ls = torch.empty((1 if shared else len(weights), n_in, n_in), dtype=torch.float32, device=device)
    factored = []
    for t, qa in enumerate(quant_args_list):
        if t and shared:
            factored.append(factored[0])
            continue
        _seed(qa)
        f = _finalize(h_datas[t], qa, Ls[t])
        if f is None:
            del Ls, factored
            return x.quantize_exl3_batch(weights, h_datas, quant_args_list)
        factored.append(f)

    regularized = [_regularize(x, weights[t], factored[t], qa, device) for t, qa in enumerate(quant_args_list)]
    samples = [x.sample_scale_tiles(r[0]) * x.ldlq_drift(qa0["K"]) for r in regularized]
    g_scales = [g for g, _ in x.g_scale_search_batch(samples, qa0)]
    del samples
    for r, g in zip(regularized, g_scales):
        r[0] *= g
        r[1] /= g

    if shared:
        widths = [r[0].shape[1] for r in regularized]
        weight_r = torch.cat([r[0] for r in regularized], dim=1)
        _drop_weights(regularized)
        weight_q, encoded = x.ldlq(weight_r, Ls[0], qa0, None)
        weight_rs = torch.split(weight_r, widths, dim=1)
        weight_qs = torch.split(weight_q, widths, dim=1)
        encodeds = torch.split(encoded, [w // 16 for w in widths], dim=1)
    else:
        weight_r = torch.stack([r[0] for r in regularized])
        _drop_weights(regularized)
        weight_q, encoded = x.ldlq_batched(weight_r, Ls, qa0, None)
        weight_rs, weight_qs, encodeds = weight_r.unbind(0), weight_q.unbind(0), encoded.unbind(0)
    del Ls, weight_r, weight_q, encoded
    results = []
    for t, qa in enumerate(quant_args_list):
        results.append(_finish(x, weight_rs[t], weight_qs[t], encodeds[t], factored[t], regularized[t], g_scales[t], qa))
        factored[t] = regularized[t] = None  # each Hessian and original weight freed once its tensor is done
    return results


def _drop_weights(regularized: list[list]) -> None:
    """The regularized weights once concatenated or stacked for LDLQ: the copies are what is read from then on."""
    for r in regularized:
        r[0] = None


def _seed(quant_args: dict) -> None:
    """exllamav3 reseeds torch before each tensor's random sign flips."""
    if "seed" in quant_args:
        torch.manual_seed(quant_args["seed"])


def _regularize(x, weight: torch.Tensor, f: _Factored, quant_args: dict, device: torch.device) -> list:
    """exllamav3's regularize with the scale search deferred: [weight, su, sv, apply_out_scales, original]
    (the weight changed in place, as exllamav3 changes it; the original kept for the refit)."""
    _seed(quant_args)
    weight = weight.to(device).float()
    sv = (torch.randn(weight.shape[1], device=device).sign() + 1e-5).sign().to(torch.float).unsqueeze(0)
    original = weight.clone() if weight.numel() <= ORIGINAL_ON_HOST_ABOVE else weight.cpu()
    apply_out_scales, weight_r, _, su, sv = x.regularize(weight, f.su, sv, quant_args, False, f.diag, None,
                                                         skip_g_scale=True)
    return [weight_r, su, sv, apply_out_scales, original]


def _finish(x, weight_r, weight_q, encoded, f: _Factored, reg: list, g_scale: float, quant_args: dict):
    """The proxy error, the refit of the scales and the packed tensors of one weight, as exllamav3 makes them."""
    _, su, sv, apply_out_scales, original = reg
    try:
        num = x.block_trace(weight_r - weight_q, f.H)
        proxy_err = num / max(x.block_trace(weight_r, f.H), 1e-8)
    except torch.OutOfMemoryError:
        proxy_err = -1.0
    if not quant_args.get("no_refit"):
        wq = x.preapply_had_l(weight_q, x.had_k)
        wq *= su
        wq = x.preapply_had_r(wq, x.had_n)
        wq *= sv
        _, su_f, sv_f, _, proxy_err = x.refit_scales(original, wq, x.unrotate_H(f.H, f.su), su, sv,
                                                     damping=x.damping_share(quant_args))
        su = su_f.view(-1, 1).to(su.dtype)
        sv = sv_f.view(1, -1).to(sv.dtype)
    tensors = {
        "suh": su.flatten().contiguous().to(dtype=torch.half, copy=True),
        "svh": sv.flatten().contiguous().to(dtype=torch.half, copy=True),
        "trellis": x.pack_trellis(encoded.contiguous(), quant_args),
        **x.codebook_markers(quant_args),
    }
    quant_args.update({"apply_out_scales": apply_out_scales, "g_scale": g_scale, "q_fallback": False})
    return proxy_err, tensors
