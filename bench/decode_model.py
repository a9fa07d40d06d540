"""The decode model's constants, fitted to the decode rates people published for V4.1-Flash on Sparks, with one
measurement held out of the fit (issue 58; quantizer/fit/decode.py, docs/decode-speed.md).

Each published rate is a pack in an engine on some Sparks, single stream: its bit map (configs/recipes/published,
or the plan our allocator makes for the one-Spark recipe's 1.59 bpw layout), the engine's dispatch (its loader
profile's `decode`), its context and whether the drafter ran. fit/decode.py gives each one's bytes and launches;
the bandwidth is the GB10's measured 250 GB/s and the three launch and all-reduce costs are the least-squares fit of
the rates without the drafter, in relative error. The measurement held out is TensorFold's on two Sparks (a third
engine, none of whose numbers enter the fit); the rates with the drafter are predictions too. Prints the fit, every
point's bytes, launches, predicted and published rate and their ratio, and writes --json.

    python bench/decode_model.py [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.contract.loader_profiles import DEFAULT_OVERLAY, GATE_UP, Overlay, load_profile  # noqa: E402
from quantizer.contract.pack_spec import pack_spec  # noqa: E402
from quantizer.contract.rules import for_profile  # noqa: E402
from quantizer.fit.decode import decode_cost, rates  # noqa: E402
from quantizer.fit.hardware import Decoding, load_hardware  # noqa: E402
from quantizer.plan.allocate import AllocationSettings, allocate  # noqa: E402
from quantizer.plan.recipe import plan_from_recipe, read_recipe  # noqa: E402
from quantizer.plan.sensitivity import sensitivity, synthetic_summary  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import model_config_path  # noqa: E402
from quantizer.workdir import write_json_atomic  # noqa: E402

BANDWIDTH_GBPS = 250.0  # GB10, as the sources measured it (docs/decode-speed.md: about 250-273 GB/s)


@dataclass(frozen=True)
class Published:
    name: str
    pack: str  # a published recipe's name, or "sage-1.59": our allocator's plan of the recipe's layout
    loader: str  # the profile whose engine dispatch it ran
    sparks: int
    context: int
    drafter: bool
    rate: float  # tokens per second, single stream
    source: str
    role: str  # "fit" (the launch costs), "fit drafter" (the acceptance), "held out"
    fused_tie: str | None = None  # another engine's fused tie (the cuda-exl3 plugin takes gate = up, down free)
    graphed: bool | None = None  # the engine's CUDA graphs forced on or off (vLLM's --enforce-eager)


POINTS = (
    Published("one Spark, 1.59 bpw, no drafter", "sage-1.59", "exllamav3-v41", 1, 6144, False, 15.13,
              "vcruz305/DeepSeek-V4.1-Flash-EXL3-DGX-Spark-recipe one-spark-tp1/BENCHMARKS.md @033c344f (15.13-15.22)",
              "fit"),
    Published("two Sparks, Mia 2.9, vLLM, no drafter", "mia-2.9", "vllm-exl3", 2, 4096, False, 23.0,
              "MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks README.md @145bb98d ('With SPEC_METHOD=none a "
              "single stream drops to 23 tok/s')", "fit"),
    Published("three Sparks, Pollard 3.51, vLLM eager", "pollard-3.51", "vllm-exl3", 3, 4096, False, 17.4,
              "tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark docs/EXL3-TP3.md @0d54f51f (exl3tp3a6, C1 per stream)",
              "fit", GATE_UP, False),
    Published("three Sparks, Pollard 3.51, vLLM CUDA graphs", "pollard-3.51", "vllm-exl3", 3, 4096, False, 26.5,
              "tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark docs/EXL3-TP3.md @0d54f51f (exl3tp3a7, C1 per stream)",
              "fit", GATE_UP, True),
    Published("two Sparks, Mia 2.9, TensorFold, no drafter", "mia-2.9", "tensorfold", 2, 4096, False, 30.0,
              "bertholomus/TensorFold tools/dsv41/REPORT.md @808eb4a1 ('Serial decode ~30 tok/s')", "held out"),
    Published("one Spark, 1.59 bpw, drafter", "sage-1.59", "exllamav3-v41", 1, 6144, True, 17.53,
              "one-spark-tp1/BENCHMARKS.md @033c344f (median on fresh prompts, DSpark block 5)", "fit drafter"),
    Published("two Sparks, Mia 2.9, vLLM, drafter", "mia-2.9", "vllm-exl3", 2, 4096, True, 31.6,
              "MiaAI-Lab README.md @145bb98d (DSpark k=3, 400-token prose)", "held out"),
    Published("two Sparks, Mia 2.9, TensorFold, drafter", "mia-2.9", "tensorfold", 2, 4096, True, 38.0,
              "bertholomus/TensorFold tools/dsv41/REPORT.md @808eb4a1 (greedy prose)", "held out"),
)


def _plans(cfg: ModelConfig) -> dict:
    summary = synthetic_summary(cfg)
    sage = allocate(cfg, sensitivity(cfg, summary, "mul1"), 1.59, AllocationSettings(
        profile=load_profile("exllamav3-v41"), head_bits=None, overlay=Overlay(DEFAULT_OVERLAY), expert_layout="per-expert"))
    plans = {"sage-1.59": sage}
    for name in ("mia-2.9", "pollard-3.51"):
        plans[name] = plan_from_recipe(cfg, read_recipe(name), keep_rules=False)
    return plans


def measure(points=POINTS, hw=None) -> list[dict]:
    """Every published point's bytes and launches (fit/decode.py) under `hw`'s decode constants."""
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    hw = hw or load_hardware()
    plans, out, packs = _plans(cfg), [], {}
    for p in points:
        profile = load_profile(p.loader)
        if p.fused_tie:
            profile = replace(profile, layouts=replace(profile.layouts, fused_tie=p.fused_tie))
        if (p.pack, p.loader) not in packs:  # a pack laid out for its engine, once
            plan = for_profile(cfg, plans[p.pack], load_profile(p.loader))
            packs[p.pack, p.loader] = plan, list(pack_spec(cfg, plan).tensors)
        plan, stored = packs[p.pack, p.loader]
        cost = decode_cost(cfg, plan, stored, profile, p.sparks, hw, p.context, p.drafter, graphed=p.graphed)
        out.append({"point": p, "cost": cost})
    return out


def fit_constants(rows: list[dict], hw) -> Decoding:
    """The decode constants fitted to the published points: the eager and graph launch costs and the all-reduce cost
    (us) that best predict the fit points' seconds per token at BANDWIDTH_GBPS (least squares in relative error),
    then the draft acceptance that gives the drafter point's rate under them (bisection)."""
    a, b = [], []
    for row in rows:
        p, c = row["point"], row["cost"]
        if p.role != "fit":
            continue
        t = 1 / p.rate
        a.append([c.launches_per_token * (not c.graphed) / t, c.launches_per_token * c.graphed / t,
                  c.reduces_per_token / t])
        b.append((t - c.gib_per_token * 2**30 / (BANDWIDTH_GBPS * 1e9)) / t * 1e6)
    eager, graph, reduce = np.linalg.lstsq(np.asarray(a), np.asarray(b), rcond=None)[0]
    k = replace(hw.decode, bandwidth_gbps=BANDWIDTH_GBPS, eager_launch_us=round(float(eager), 2),
                graph_launch_us=round(float(graph), 2), allreduce_us=round(float(reduce), 2))
    drafter = next(row for row in rows if row["point"].role == "fit drafter")
    lo, hi = 0.0, 0.999
    for _ in range(40):  # the rate rises with the acceptance
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rates(drafter["cost"], replace(k, draft_acceptance=mid))[1] < drafter["point"].rate \
            else (lo, mid)
    return replace(k, draft_acceptance=round((lo + hi) / 2, 3))


def report(rows: list[dict], k: Decoding) -> list[dict]:
    """Every point under the constants `k`: bytes, launches, predicted and published rate, their ratio."""
    out = []
    for row in rows:
        p, c = row["point"], row["cost"]
        plain, with_drafter = rates(c, k)
        predicted = with_drafter if p.drafter else plain
        out.append({"point": p.name, "role": p.role, "gib": round(c.gib_per_token, 3), "launches": c.launches_per_token,
                    "graphed": c.graphed, "predicted": round(predicted, 2), "published": p.rate,
                    "ratio": round(predicted / p.rate, 3), "source": p.source})
    return out


FITTED = ("bandwidth_gbps", "eager_launch_us", "graph_launch_us", "allreduce_us", "draft_acceptance")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the fit and every point here")
    args = parser.parse_args(argv)
    hw = load_hardware()
    measured = measure(hw=hw)
    fitted = fit_constants(measured, hw)
    constants = {k: getattr(fitted, k) for k in FITTED}
    shipped = {k: getattr(hw.decode, k) for k in FITTED}
    rows = report(measured, fitted)
    print(f"fit: {constants} (shipped in configs/hardware/gb10.json: {shipped})")
    print(table(["point", "role", "GiB/token", "launches", "graphs", "predicted", "published", "ratio"],
                [[r["point"], r["role"], f"{r['gib']:.2f}", f"{r['launches']:,}", "yes" if r["graphed"] else "no",
                  f"{r['predicted']:.1f}", f"{r['published']:.1f}", f"{r['ratio']:.2f}"] for r in rows]))
    if args.json:
        write_json_atomic(args.json, {"fit": constants, "shipped": shipped, "points": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
