"""The one-Spark fit (engine exllamav3-v41) against what the recipe measured on a Spark.

vcruz305/DeepSeek-V4.1-Flash-EXL3-DGX-Spark-recipe `one-spark-tp1/BENCHMARKS.md` @033c344f ("Context is nearly
free") reports torch_alloc for the 1.59 bpw pack with its EXL3 attention / MTP overlay, main model copied and
drafter mapped (`EXL3_ATS_COPY='^(?!mtp\\.)'`): 107.19 GiB at 6,144 tokens, 108.69 GiB at 262,144. The pack's
routed experts hold K1 x27,210, K2 x11,811, K3 x5,774, K4 x1,221, K5 x62, K6 x2 (attestation
tp2-sage159-0c29707b-metadata.json), 1.592 bits per routed weight. This plans the same layout (uniform at
1.592 bits per routed weight, `--overlay`), runs our fit at both contexts and prints what it charges to CUDA
memory (weights copied, less the unquantized embedding exllamav3 keeps in host memory, plus the caches)
over the measured torch_alloc:

    python bench/one_spark_fit.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import DEFAULT_OVERLAY, EXLLAMAV3_V41, Overlay, load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.fit.hardware import GIB, load_hardware
from quantizer.fit.memory import FitTarget, fit
from quantizer.plan.uniform import uniform_plan
from quantizer.report import table
from quantizer.shipped import model_config_path

MEASURED_TORCH_ALLOC_GIB = {6_144: 107.19, 262_144: 108.69}
ROUTED_K_HISTOGRAM = {1: 27_210, 2: 11_811, 3: 5_774, 4: 1_221, 5: 62, 6: 2}
HOST_RESIDENT = ("embed",)  # exllamav3's Embedding prefers the CPU when unquantized (modules/embedding.py)


def rows() -> list[dict]:
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    bits = sum(k * n for k, n in ROUTED_K_HISTOGRAM.items()) / sum(ROUTED_K_HISTOGRAM.values())
    plan = uniform_plan(cfg, bits, profile=load_profile(EXLLAMAV3_V41), head_bits=None, overlay=Overlay(DEFAULT_OVERLAY))
    stored = pack_spec(cfg, plan).tensors
    engine = load_hardware().engine(EXLLAMAV3_V41)
    fixed = next(r.gib for r in engine.runtime if "fixed-shape" in r.name)
    out = []
    for context, measured in MEASURED_TORCH_ALLOC_GIB.items():
        rank = fit(cfg, stored, FitTarget(1, context, 1, EXLLAMAV3_V41)).ranks[0]
        cuda = rank.weights_gib - sum(rank.weights_by_class_gib.get(c, 0.0) for c in HOST_RESIDENT)
        estimate = cuda + rank.kv_pool_gib + fixed
        out.append({"context": context, "bits": bits, "copied_gib": rank.weights_gib, "mapped_gib": rank.mapped_gib,
                    "estimate_gib": estimate, "measured_gib": measured, "ratio": estimate / measured,
                    "free_gib": rank.free_gib, "kv_gib": rank.kv_pool_gib})
    return out


def main() -> None:
    measured = rows()
    print(f"1.59 bpw pack with the overlay ({measured[0]['bits']:.3f} bits per routed weight), engine {EXLLAMAV3_V41}")
    print(table(["context", "copied GiB", "mapped GiB", "KV GiB", "CUDA estimate GiB", "torch_alloc measured GiB",
                 "ratio", "free GiB (after the guard)"],
                [[f"{r['context']:,}", f"{r['copied_gib']:.2f}", f"{r['mapped_gib']:.2f}", f"{r['kv_gib']:.3f}",
                  f"{r['estimate_gib']:.2f}", f"{r['measured_gib']:.2f}", f"{r['ratio']:.3f}", f"{r['free_gib']:.2f}"]
                 for r in measured]))
    growth = measured[1]["estimate_gib"] - measured[0]["estimate_gib"]
    print(f"growth 6,144 -> 262,144 tokens: estimate {growth:.2f} GiB, measured "
          f"{MEASURED_TORCH_ALLOC_GIB[262_144] - MEASURED_TORCH_ALLOC_GIB[6_144]:.2f} GiB ({GIB:,} B per GiB)")


if __name__ == "__main__":
    main()
