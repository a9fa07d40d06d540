"""Where the project touches exllamav3 (1.6.5, CUDA only): its quantizer and its reference decode (here, and
in exllamav3_batch.py, our run of its batch conversion).

exllamav3 compiles its CUDA extension when imported, so every import here happens inside a function and
`import quantizer.codec` keeps working on machines without CUDA. Weights come and go in HF orientation
(out, in) and as EXL3Linear, like the CPU codec; exllamav3 itself works on (in, out).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

import torch

from quantizer.caches import on_reset
from quantizer.exl3 import Codebook, parse_codebook, trellis_k

from .linear import check_linear_inputs
from .packed import EXL3Linear


def _cuda(device: torch.device | str) -> torch.device:
    """The CUDA device with its index made explicit (exllamav3 keys its buffers by index)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"exllamav3 quantizes on a CUDA device, got {device}; use the CPU codec (quantize_linear)")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _own_rng(device: torch.device):
    """exllamav3 seeds torch's global generators itself (`torch.manual_seed(seed)` in quantize_exl3):
    run it on a fork of the CPU's and the device's generators, so a caller's random stream is the
    same whether or not something was quantized in between (docs/exl3-format.md, encoder)."""
    return torch.random.fork_rng(devices=[device.index])


def _batch_conversion(which: str):
    """exllamav3's batch conversion as `which` encoder runs it: "exllamav3", its `quantize_exl3_batch`
    unchanged; "ours", the same steps with the Hessians kept on the GPU (exllamav3_batch.py) and the tile
    searches in our kernel (quantizer/codec/kernel). Both store the same tensors. Returns a context for
    the call and the function to call."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3_batch

    if which == "exllamav3":
        return contextlib.nullcontext(), quantize_exl3_batch
    if which != "ours":
        raise ValueError(f"encoder {which!r}; ours or exllamav3")
    from quantizer.codec.kernel import in_exllamav3

    from .exllamav3_batch import quantize_exl3_batch_on_device

    return in_exllamav3(), quantize_exl3_batch_on_device


def _quant_args(K: float, codebook: Codebook, seed: int, device: torch.device,
                apply_out_scales: bool | None) -> dict:
    return {
        "K": K,
        "devices": [device.index],
        "seed": seed,
        "mul1": codebook is Codebook.MUL1,
        "mcg": codebook is Codebook.MCG,
        "apply_out_scales": apply_out_scales,
    }


def _h_data(in_features: int, hessian: torch.Tensor | None, count: int, device: torch.device, key: str) -> dict:
    """The dict Linear.init_H_data / capture_H build: a dense (unpacked) H summed over `count` rows, or a
    meta H meaning uncalibrated (exllamav3 then quantizes with plain MSE)."""
    calibrated = hessian is not None and count > 0
    h = (hessian.to(device=device, dtype=torch.float32, copy=True) if calibrated else
         torch.zeros(in_features, in_features, dtype=torch.float32, device="meta"))
    return {
        "H": h,
        "packed": False,
        "n": in_features,
        "first_key": key,
        "count": count if calibrated else 0,
        "finalized": False,
        "num_total": 0,
        "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
        "device": device,
    }


def _to_linear(out_tensors: dict, codebook: Codebook, K: float, proxy_err: float) -> EXL3Linear:
    return EXL3Linear(
        trellis=out_tensors["trellis"].cpu(),
        suh=out_tensors["suh"].cpu(),
        svh=out_tensors["svh"].cpu(),
        codebook=codebook,
        K=K,
        proxy_err=float(proxy_err),
    )


def quantize(
    weight: torch.Tensor,
    K: float,
    hessian: torch.Tensor | None = None,
    count: int = 1,
    *,
    codebook: Codebook | str = Codebook.MUL1,
    seed: int = 0,
    device: torch.device | str = "cuda",
    apply_out_scales: bool | None = None,
) -> EXL3Linear:
    """exllamav3's quantize_exl3 on one HF weight (out, in); hessian (in, in) summed over `count` rows."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3

    cb = parse_codebook(codebook)
    k = trellis_k(K, cb)
    check_linear_inputs(weight, hessian, count)
    device = _cuda(device)
    qa = _quant_args(k, cb, seed, device, apply_out_scales)
    w = weight.detach().to(device=device, dtype=torch.float32).T.contiguous()
    with _own_rng(device):
        _, proxy_err, out = quantize_exl3(w, _h_data(w.shape[0], hessian, count, device, "weight"), qa, False)
    return _to_linear(out, cb, k, proxy_err)


def quantize_batch(
    weights: Sequence[torch.Tensor],
    K: float,
    hessians: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    *,
    counts: int | Sequence[int] = 1,
    codebook: Codebook | str = Codebook.MUL1,
    seed: int = 0,
    device: torch.device | str = "cuda",
    apply_out_scales: bool | None = None,
    encoder: str = "exllamav3",
) -> list[EXL3Linear]:
    """exllamav3's quantize_exl3_batch: same-shape HF weights at one K, sharing one Hessian (a single tensor,
    e.g. gate/up of every expert) or each with its own (a sequence, e.g. every expert's down). `encoder`
    "ours" runs it with the Hessians on the GPU and our tile kernel, "exllamav3" as exllamav3 runs it: the
    same tensors (`_batch_conversion`)."""
    context, convert = _batch_conversion(encoder)
    cb = parse_codebook(codebook)
    k = trellis_k(K, cb)
    if not weights or len({tuple(w.shape) for w in weights}) != 1:
        raise ValueError("quantize_batch needs one or more same-shape weights")
    device = _cuda(device)
    in_features = weights[0].shape[1]
    shared = hessians is None or isinstance(hessians, torch.Tensor)
    per_h = [hessians] * len(weights) if shared else list(hessians)
    per_count = [counts] * len(weights) if isinstance(counts, int) else list(counts)
    if len(per_h) != len(weights) or len(per_count) != len(weights):
        raise ValueError(f"{len(weights)} weights need as many Hessians and counts")
    for w, h, c in zip(weights, per_h, per_count):
        check_linear_inputs(w, h, c)
    if shared:
        h_datas = [_h_data(in_features, hessians, per_count[0], device, "shared")] * len(weights)
    else:
        h_datas = [_h_data(in_features, h, c, device, f"weight.{i}") for i, (h, c) in enumerate(zip(per_h, per_count))]
    qas = [_quant_args(k, cb, seed + i, device, apply_out_scales) for i in range(len(weights))]
    ws = [w.detach().to(dtype=torch.float32).T.contiguous() for w in weights]
    with _own_rng(device), context:
        results = convert(ws, h_datas, qas)
    return [_to_linear(out, cb, k, proxy_err) for proxy_err, out in results]


@on_reset
def release_encoder_buffers() -> None:
    """Free the trellis-search scratch exllamav3 keeps per (device, K) once it has encoded at that K
    (`get_temp_buffers`, `get_temp_buffers_frac`: int16 edges of 256 x 2^(16-K) per tile in flight,
    1-2 GiB at K 2; 5.3 GiB after a 2.5 bpw small-model build: docs/exl3-format.md). Nothing reads
    them between calls, so the stages after quantization get that memory back."""
    if "exllamav3.modules.quant.exl3_lib.quantize" not in sys.modules:
        return  # nothing was encoded in this process: importing would compile the extension for nothing
    from exllamav3.modules.quant.exl3_lib import quantize as encoder

    encoder.get_temp_buffers.cache_clear()
    encoder.get_temp_buffers_frac.cache_clear()
    torch.cuda.empty_cache()


def load_linear(q: EXL3Linear, device: torch.device | str = "cuda"):
    """exllamav3's own LinearEXL3 built from our tensors: the proof that exllamav3 accepts them."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    tensors = {name.split(".", 1)[1]: t.to(device) for name, t in q.tensors("w").items()}
    return LinearEXL3(
        None, q.in_features, q.out_features,
        suh=tensors["suh"], svh=tensors["svh"], trellis=tensors["trellis"],
        mcg=tensors.get("mcg"), mul1=tensors.get("mul1"), out_dtype=torch.half,
    )


def reconstruct_rotated(q: EXL3Linear, device: torch.device | str = "cuda") -> torch.Tensor:
    """fp16 (in, out) rotated-basis weight from exllamav3's CUDA `reconstruct` kernel (the bit-exact reference)."""
    from exllamav3.ext import exllamav3_ext as ext

    w = torch.empty(q.in_features, q.out_features, dtype=torch.half, device=device)
    ext.reconstruct(w, q.trellis.to(device), float(q.K), q.codebook is Codebook.MCG, q.codebook is Codebook.MUL1)
    return w


def reconstruct_weight(q: EXL3Linear, device: torch.device | str = "cuda") -> torch.Tensor:
    """fp16 (in, out) original-basis weight as exllamav3 builds it (LinearEXL3.get_weight_tensor)."""
    return load_linear(q, device).get_weight_tensor()
