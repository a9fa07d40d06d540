"""Our quantize stage against exllamav3's `quantize_exl3_batch` called directly, on one GPU.

Sixteen real-shape V4.1 routed-expert w1 tensors (in 5120, out 2304) are generated on the GPU, stored
as a native MXFP4 checkpoint (what the real model ships), and quantized at K = 2, 3, 4 with one shared
random SPD Hessian, twice per K:

- direct: `quantize_exl3_batch` on the dequantized fp32 weights already on the GPU (the reference);
- ours:   `quantizer.quantize.quantize` on that checkpoint with a plan naming the 16 tensors: job
          file, source fingerprint, reading and dequantizing the FP4 bytes, the exllamav3 adapter,
          and saving the results in the work directory (everything a build does per layer).

Prints weights/s of each and ours/direct (the stage should add no real overhead: >= 0.9), and writes
$OUT/quantize_gpu.json when OUT is set. On the GPU machine:

    source .device-cache/setup.sh && python bench/quantize_gpu.py
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.checkpoint.dequant import dequantize, quantize_mxfp4
from quantizer.checkpoint.safetensors_file import planned, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.plan.plan import make_plan
from quantizer.plan.profiles import MIXEDK
from quantizer.plan.targets import targets
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import quantize
from quantizer.report import table
from quantizer.shipped import model_config_path

IN, OUT, EXPERTS = 5120, 2304, 16
HESSIAN_ROWS = 8192
KS = (2, 3, 4)
KEYS = [f"layers.0.ffn.experts.{e}.w1" for e in range(EXPERTS)]


def write_source(root: Path, device: torch.device) -> list[torch.Tensor]:
    """A native checkpoint holding the 16 experts in MXFP4; returns their dequantized fp32 [out, in] on the GPU."""
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


def shared_hessian(device: torch.device) -> tuple[torch.Tensor, int]:
    """X^T X of correlated random activations: symmetric positive definite, summed over HESSIAN_ROWS rows."""
    gen = torch.Generator(device=device).manual_seed(1)
    mix = torch.randn(IN, IN, device=device, generator=gen) / math.sqrt(IN) + torch.eye(IN, device=device)
    x = torch.randn(HESSIAN_ROWS, IN, device=device, generator=gen) @ mix
    return x.T @ x, HESSIAN_ROWS


def h_data(h: torch.Tensor, count: int, device: torch.device) -> dict:
    """The dict exllamav3's Linear.capture_H builds (dense, not yet finalized)."""
    return {"H": h.clone(), "packed": False, "n": IN, "first_key": "bench", "count": count, "finalized": False,
            "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device), "device": device}


def direct(weights, hessian, K: int, device: torch.device) -> float:
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3_batch

    shared = h_data(*hessian, device)
    args = [{"K": K, "devices": [device.index or 0], "seed": i, "mul1": True, "mcg": False, "apply_out_scales": None}
            for i in range(len(weights))]
    ws = [w.T.contiguous() for w in weights]  # exllamav3 works on (in, out)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    quantize_exl3_batch(ws, [shared] * len(ws), args)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def ours(src: Path, work: Path, hessian, K: int, device: torch.device) -> float:
    ck = Checkpoint.open(src)
    plan = make_plan(ck.config, {t.key: (float(K) if t.key in KEYS else None) for t in targets(ck.config)}, loader=MIXEDK)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    quantize(ck, plan, work, QuantizeSettings(device="cuda"), hessian=lambda key: hessian)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    device = torch.device("cuda", 0)
    n_weights = EXPERTS * IN * OUT
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights = write_source(tmp / "src", device)
        hessian = shared_hessian(device)
        direct(weights[:2], hessian, 2, device)  # warm-up: kernels, streams, pinned buffers
        for K in KS:
            t_direct = direct(weights, hessian, K, device)
            t_ours = ours(tmp / "src", tmp / f"work-K{K}", hessian, K, device)
            rate_direct, rate_ours = n_weights / t_direct, n_weights / t_ours
            ratio = rate_ours / rate_direct
            results.append({"K": K, "weights": n_weights, "direct_s": t_direct, "ours_s": t_ours,
                            "direct_weights_per_s": rate_direct, "ours_weights_per_s": rate_ours, "ratio": ratio})
            rows.append([K, f"{rate_direct / 1e6:.2f}", f"{rate_ours / 1e6:.2f}", f"{ratio:.3f}",
                         "ok" if ratio >= 0.9 else "BELOW 0.9"])
    print(f"{EXPERTS} experts x ({IN} in, {OUT} out), shared SPD Hessian, mul1, {torch.cuda.get_device_name(device)}")
    print(table(["K", "direct Mw/s", "ours Mw/s", "ours/direct", ""], rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "quantize_gpu.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
