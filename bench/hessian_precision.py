"""What storing calibration Hessians in 16 bits costs: the proxy error of linears encoded with them.

Calibrates the bundled small V4.1 model with every Hessian stored in float32 (the reference), then for
a sample of linears of every Hessian kind (attention input, q latent, wo_a slices, wo_b, MoE input,
routed and shared down projections, Engram wkv, head) encodes each with our CPU codec at K 2: with
the float32 Hessian, with it stored in float16 (calibrate/storage.py: the diagonal in float32, the
correlation triangle in 16 bits), both at one seed, and with the float32 Hessian at another seed.
Every result's proxy error tr(E H E^T) / tr(W H W^T) is measured against the float32 Hessian. The
trellis search is chaotic (any change of H moves its path), so the seed change is the noise floor
the storage change is judged against. On the CPU (about 20 minutes on 2 busy cores):

    python bench/hessian_precision.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.calibrate.stage import calibrate  # noqa: E402
from quantizer.calibrate.storage import HessianStore, pack_hessian, unpack_hessian  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.codec import dequantize, quantize_linear  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402
from quantizer.textdata import model_rows, shipped_text_path  # noqa: E402

ROWS, COLS = 32, 256
KS = (2.0,)
STORAGES = {"float16": torch.float16}
SAMPLE = ["layers.{L}.attn.wq_a", "layers.{L}.attn.wq_b", "layers.{L}.attn.wo_a.slice.0", "layers.{L}.attn.wo_b",
          "layers.{L}.ffn.experts.0.w1", "layers.{L}.ffn.experts.3.w2", "layers.{L}.ffn.shared_experts.w2",
          "layers.{L}.engram.wkv", "head"]


def proxy(w: torch.Tensor, q, h: torch.Tensor) -> float:
    e = dequantize(q) - w
    return float(((e @ h) * e).sum() / ((w @ h) * w).sum())


def main() -> None:
    ck = Checkpoint.open(shipped("small_model"))
    cfg = ck.config
    rows = model_rows(ck.root, cfg, text=shipped_text_path("calibration"), rows=ROWS, cols=COLS, default_cols=COLS)
    keys = [k.format(L=layer) for layer in cfg.engram_layer_ids[:1] for k in SAMPLE]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        calibrate(ck, rows, tmp, CalibrationSettings(expert_hessian_dtype="float32", measure_kl=False))
        store = HessianStore(tmp, ck)
        for key in keys:
            got = store.hessian(key)
            if got is None:
                continue
            h32, count = got
            base = key.split(".slice.")[0]
            w = ck.weight(base + ".weight")
            if ".slice." in key:
                g, width = int(key.rsplit(".", 1)[1]), w.shape[0] // cfg.o_groups
                w = w[g * width : (g + 1) * width]
            for K in KS:
                ref = proxy(w, quantize_linear(w, K, h32, count, seed=1), h32)
                row = {"key": key, "K": K, "float32": ref,
                       "float32_seed2": proxy(w, quantize_linear(w, K, h32, count, seed=2), h32)}
                for name, dtype in STORAGES.items():
                    parts = pack_hessian("h", h32 / count, dtype)
                    h16 = unpack_hessian(parts["h.diag"], parts["h.corr"]) * count
                    row[name] = proxy(w, quantize_linear(w, K, h16, count, seed=1), h32)
                results.append(row)
                print(json.dumps(row), flush=True)
    print(table(["linear", "K", "proxy f32", "f16 storage", "other seed"],
                [[r["key"], f"{r['K']:g}", f"{r['float32']:.5f}", f"{r['float16'] / r['float32'] - 1:+.3%}",
                  f"{r['float32_seed2'] / r['float32'] - 1:+.3%}"] for r in results]))
    for name in (*STORAGES, "float32_seed2"):
        changes = [abs(r[name] / r["float32"] - 1) for r in results]
        print(f"{name}: mean |change| {sum(changes) / len(changes):.3%}, max {max(changes):.3%} over {len(changes)} encodes")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hessian_precision.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
