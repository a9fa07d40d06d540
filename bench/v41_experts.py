"""Sixteen real-shape DeepSeek-V4.1-Flash routed experts and their random SPD Hessians on the GPU, and the
direct `quantize_exl3_batch` call on them: what bench/quantize_gpu.py, bench/encoder_variants.py and
bench/rehearsal.py encode.

w1 (in 5120, out 2304) is stored as a native MXFP4 checkpoint (what the real model ships) and read back
dequantized; w2 (in 2304, out 5120) is fp32 Gaussian. Every tensor and Hessian comes from its own seeded
generator, so each bench sees the same experts whatever it builds first.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from quantizer.checkpoint.dequant import dequantize, quantize_mxfp4
from quantizer.checkpoint.safetensors_file import planned, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME
from quantizer.shipped import model_config_path

IN, OUT, EXPERTS = 5120, 2304, 16
HESSIAN_ROWS = 8192
KEYS = [f"layers.0.ffn.experts.{e}.w1" for e in range(EXPERTS)]
W1_HESSIANS = {"each": "one SPD Hessian each (gate2 calibration)", "shared": "one shared SPD Hessian"}


def write_source(root: Path, device: torch.device) -> list[torch.Tensor]:
    """A native checkpoint holding the 16 experts' w1 in MXFP4; returns them dequantized, fp32 [out, in] on the GPU."""
    gen = torch.Generator(device=device).manual_seed(0)
    root.mkdir(parents=True)
    tensors, weights = [], []
    for key in KEYS:
        w, s = quantize_mxfp4((torch.randn(OUT, IN, device=device, generator=gen) / math.sqrt(IN)).cpu())
        tensors += [planned(key + ".weight", w), planned(key + ".scale", s, "F8_E8M0")]
        weights.append(dequantize(w, s, key, torch.float32, device))
    write_safetensors(root / "model-00001-of-00001.safetensors", tensors, align=1)
    index = {"metadata": {"total_size": 0}, "weight_map": {t.name: "model-00001-of-00001.safetensors" for t in tensors}}
    (root / INDEX_NAME).write_text(json.dumps(index))
    (root / "config.json").write_text(model_config_path("deepseek-v4.1-flash.json").read_text())
    return weights


def w2_weights(device: torch.device) -> list[torch.Tensor]:
    """The 16 experts' w2, fp32 [out 5120, in 2304] on the GPU."""
    gen = torch.Generator(device=device).manual_seed(2)
    return [torch.randn(IN, OUT, device=device, generator=gen) / math.sqrt(OUT) for _ in range(EXPERTS)]


def spd_hessian(n: int, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, int]:
    """X^T X of correlated random activations: symmetric positive definite, summed over HESSIAN_ROWS rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mix = torch.randn(n, n, device=device, generator=gen) / math.sqrt(n) + torch.eye(n, device=device)
    x = torch.randn(HESSIAN_ROWS, n, device=device, generator=gen) @ mix
    return x.T @ x, HESSIAN_ROWS


def w1_hessians(device: torch.device, mode: str = "each"):
    """The w1 Hessians: a list of one (H, count) per expert (`each`), or one (H, count) for all (`shared`)."""
    return spd_hessian(IN, device) if mode == "shared" else [spd_hessian(IN, device, seed=100 + e) for e in range(EXPERTS)]


def w2_hessians(device: torch.device) -> list[tuple[torch.Tensor, int]]:
    """The w2 Hessians, one (H, count) per expert."""
    return [spd_hessian(OUT, device, seed=10 + e) for e in range(EXPERTS)]


def h_data(h: torch.Tensor, count: int, device: torch.device) -> dict:
    """The dict exllamav3's Linear.capture_H builds (dense, not yet finalized)."""
    return {"H": h.clone(), "packed": False, "n": h.shape[0], "first_key": "bench", "count": count,
            "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
            "device": device}


def encode(weights, hessians, K: float, device: torch.device, convert=None) -> tuple[float, list, list[dict]]:
    """One `quantize_exl3_batch` call (or `convert`, a function of its arguments) on [out, in] weights (mul1,
    seed i for the i-th), `hessians` one shared (H, count) or a list of them, one per weight: its seconds
    (synchronized, the Hessian copies made before), its results (proxy error, {suh, svh, trellis, mul1}) per
    weight, and the quant_args it updated (g_scale)."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3_batch

    if isinstance(hessians, tuple):
        h_datas = [h_data(*hessians, device)] * len(weights)
    else:
        h_datas = [h_data(h, c, device) for h, c in hessians]
    k = int(K) if float(K).is_integer() else float(K)
    args = [{"K": k, "devices": [device.index or 0], "seed": i, "mul1": True, "mcg": False, "apply_out_scales": None}
            for i in range(len(weights))]
    ws = [w.T.contiguous() for w in weights]  # exllamav3 works on (in, out)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    results = (convert or quantize_exl3_batch)(ws, h_datas, args)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start, results, args


def direct(weights, hessians, K: float, device: torch.device) -> float:
    """Seconds of one `quantize_exl3_batch` call on [out, in] weights; `hessians` as for `encode`."""
    return encode(weights, hessians, K, device)[0]
