"""The quality each routed-expert layout costs at equal bits (issue 58): the 64-expert testbed planned by our
allocator per expert, in groups, and per layer, with and without half rates, encoded by our CPU codec and measured
in our forward against the native model (KL, top-1, NLL delta on held-out rows); the reference in the same run is
the per-expert plan at the same budget.

Stock exllamav3, the engine that runs this DeepSeek-V4 testbed, loads one K per projection per layer only, so the
per-expert and grouped plans break its rules: they are planned under its profile with per-expert K allowed and
packed without verify, and measured in our forward (bit-exact with exllamav3's decode). The per-layer packs are
ordinary exllamav3 packs (tests/gpu measures them in exllamav3 too). One work directory holds the calibration and
the encodings, so a rerun encodes only what it lacks.

    python bench/expert_layouts.py [--work W] [--sizes 2.5,3] [--half-rates both|on|off] [--calib-rows 16]
        [--eval-rows 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.calibrate.stage import calibrate  # noqa: E402
from quantizer.calibrate.storage import HessianStore  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.contract.loader_profiles import EXPERT_LAYOUTS, EXLLAMAV3, load_profile  # noqa: E402
from quantizer.pack.writer import PackSettings, publish_pack, write_pack  # noqa: E402
from quantizer.plan.allocate import AllocationSettings, Allocator  # noqa: E402
from quantizer.plan.sensitivity import sensitivity  # noqa: E402
from quantizer.ppl.compare import compare  # noqa: E402
from quantizer.ppl.measure import open_model, streamer  # noqa: E402
from quantizer.ppl.perplexity import row_predictions  # noqa: E402
from quantizer.quantize.settings import QuantizeSettings  # noqa: E402
from quantizer.quantize.stage import quantize  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402
from quantizer.textdata import model_rows, shipped_text_path  # noqa: E402
from quantizer.workdir import write_json_atomic  # noqa: E402


def layouts_profile():
    """Stock exllamav3's profile with K per expert and projection allowed: the rules a measurement of every layout
    on the DeepSeek-V4 testbed needs (its plans are not packs exllamav3 loads)."""
    base = load_profile(EXLLAMAV3)
    return replace(base, per_expert_k=True, tie_gate_up=False, layouts=replace(base.layouts, allowed=EXPERT_LAYOUTS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/expert-layouts"))
    parser.add_argument("--model", default="small_model_v4_moe64")
    parser.add_argument("--sizes", default="2.5,3", help="bits per weight over the budgeted tensors")
    parser.add_argument("--calib-rows", type=int, default=16)
    parser.add_argument("--eval-rows", type=int, default=16)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--half-rates", choices=("both", "on", "off"), default="both",
                        help="plan with half rates, without, or both (default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    start = time.monotonic()
    ck = Checkpoint.open(shipped(args.model))
    cfg = ck.config
    rows = model_rows(ck.root, cfg, text=shipped_text_path("calibration"), rows=args.calib_rows, cols=args.cols,
                      default_cols=args.cols)
    summary = calibrate(ck, rows, args.work, CalibrationSettings(device="cpu")).summary
    store = HessianStore(args.work, ck)
    sens = sensitivity(cfg, summary, "mul1")
    profile = layouts_profile()
    held = model_rows(ck.root, cfg, text=shipped_text_path("heldout"), rows=args.eval_rows, cols=args.cols,
                      default_cols=args.cols)
    reference = list(row_predictions(streamer(ck, quiet=True), held))
    quantize_settings = QuantizeSettings(device="cpu", encoder="fast", hessians=store.record)
    out = []
    for size in (float(s) for s in args.sizes.split(",")):
        for layout in EXPERT_LAYOUTS:
            for halves in {"both": (True, False), "on": (True,), "off": (False,)}[args.half_rates]:
                settings = AllocationSettings(profile=load_profile(EXLLAMAV3), expert_layout=layout, half_rates=halves)
                alloc = Allocator(cfg, sens, settings, profile=None if layout == "per-layer" else profile)
                plan = alloc.plan(size * alloc.total_numel, size)
                name = f"{size:g}-{layout}-{'halves' if halves else 'integer'}"
                print(f"expert_layouts: {name}: {plan.achieved_bpw:.4f} bpw", file=sys.stderr, flush=True)
                quantize(ck, plan, args.work / "quantize", quantize_settings, store.hessian)
                pack = args.work / "packs" / name
                shutil.rmtree(pack, ignore_errors=True)
                partial = args.work / "packs" / f".partial-{name}"
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                manifest = write_pack(ck, plan, args.work / "quantize", pack, PackSettings(quantize_settings.record()),
                                      partial, publish=False)
                publish_pack(partial, pack)
                c = compare(reference, row_predictions(streamer(open_model(pack), quiet=True), held))
                out.append({"bpw": size, "layout": layout, "half_rates": halves, "achieved_bpw": plan.achieved_bpw,
                            "bytes": sum(s.bytes for s in manifest.shards), "kl": c.kl, "kl_stderr": c.kl_stderr,
                            "top1": c.top1, "nll_delta": c.nll_delta, "nll_delta_stderr": c.nll_delta_stderr,
                            "pack": str(pack)})
    for row in out:
        ref = next(r for r in out if r["bpw"] == row["bpw"] and r["layout"] == "per-expert"
                   and r["half_rates"] == (args.half_rates != "off"))
        row["kl_ratio"] = row["kl"] / ref["kl"]
    print(table(["bpw", "layout", "half rates", "achieved", "bytes", "KL", "top-1", "NLL delta", "KL / per-expert"],
                [[f"{r['bpw']:g}", r["layout"], "yes" if r["half_rates"] else "no", f"{r['achieved_bpw']:.3f}",
                  f"{r['bytes']:,}", f"{r['kl']:.4f} ± {r['kl_stderr']:.4f}", f"{r['top1']:.2%}",
                  f"{r['nll_delta']:+.4f} ± {r['nll_delta_stderr']:.4f}", f"{r['kl_ratio']:.3f}"] for r in out]))
    print(f"{time.monotonic() - start:.0f} s")
    if args.json:
        write_json_atomic(args.json, {"model": args.model, "rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
