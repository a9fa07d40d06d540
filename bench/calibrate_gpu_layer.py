"""One full-size DeepSeek-V4.1-Flash layer through the calibrate stage's collector on a GPU.

Random bf16 weights (bench/forward_gpu_layer.py builds them) and 8 rows x 2048 tokens (one default
row chunk) go through the layer three ways in the same run: the plain top-k forward (the reference),
the collector with all-experts capture, and the collector without it; then the routed experts' own
gate/up Hessians (the default --expert-hessians gate2; made from every kept row, so they may grow with the
rows: the all-experts run is repeated on twice the rows and that step extrapolated linearly) and the collector's finish
(means, LDLQ factors, out energies, alias search, packing to the CPU). Printed: times, ratios to
the plain forward, peak memory next to the stage's estimate, and the projected time of one layer
and of the whole model at 250 rows x 2048.

    python bench/calibrate_gpu_layer.py            # H200: full size
    python bench/calibrate_gpu_layer.py --tiny     # any machine: tiny shapes, checks the logic

Writes $OUT/calibrate_gpu_layer.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from forward_gpu_layer import Timer, random_block  # noqa: E402

from quantizer.calibrate.collect import LayerCollector  # noqa: E402
from quantizer.calibrate.needs import calibration_needs  # noqa: E402
from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.model.state import ForwardState  # noqa: E402
from quantizer.report import table  # noqa: E402

FULL_ROWS = 250


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny-v41 shapes, 2 x 64 tokens, any device")
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--rows", type=int)
    p.add_argument("--cols", type=int)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    config = "tiny-v41.json" if args.tiny else "deepseek-v4.1-flash.json"
    cfg = ModelConfig.from_file(ROOT / "configs" / "models" / config)
    rows, cols = args.rows or (2 if args.tiny else 8), args.cols or (64 if args.tiny else 2048)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device.type != "cuda":
        sys.exit("calibrate_gpu_layer: no CUDA device; run with --tiny to check the logic on a CPU")
    if args.layer in cfg.engram_layer_ids:
        sys.exit(f"calibrate_gpu_layer: layer {args.layer} has Engram tables; pick another layer")
    settings = CalibrationSettings(device=device.type)
    dtype = settings.dtype
    timer = Timer(device)
    block = random_block(cfg, args.layer, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (rows, cols), device=device, generator=gen)
    streams = torch.randn(rows, cols, cfg.hc_mult, cfg.hidden_size, device=device, generator=gen)

    def parts():
        return [(streams.clone(), ForwardState.start(cfg, tokens, dtype))]

    def plain():
        with torch.no_grad():
            for s, state in parts():
                block(s, state, None, None)

    results = [{"mode": "plain top-k forward", "seconds": timer.best(plain, 2)}]
    finish, experts = {}, {}
    # the routed experts' own Hessians are built from every kept row at the end of the layer, so their time
    # may grow with the rows: the all-experts collector runs once more on twice the rows (two chunks, as a
    # real run feeds them) and that step is extrapolated from the two points
    for all_experts, chunks in ((True, 1), (True, 2), (False, 1)):
        run_settings = CalibrationSettings(device=device.type, all_experts=all_experts)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        collector = LayerCollector(cfg, args.layer, run_settings, chunks * rows * cols, 1, device)
        with torch.no_grad():
            timer.sync()
            t0 = time.perf_counter()
            collector.run(block, [p for _ in range(chunks) for p in parts()], None)
            timer.sync()
            t1 = time.perf_counter()
            collector.reduce()  # one process: the experts' own input Hessians, where the settings ask for them
            timer.sync()
            t2 = time.perf_counter()
            collector.finish(block)
            timer.sync()
            t3 = time.perf_counter()
        mode = "collect, all experts" if all_experts else "collect, top-k + sampled prior"
        if chunks == 1:
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            results.append({"mode": mode, "seconds": t1 - t0, "peak_gib": peak / 2**30})
            finish[mode] = t3 - t2
        if all_experts:
            experts[chunks * rows] = t2 - t1
    (r1, e1), (r2, e2) = sorted(experts.items())
    experts_full = max(e1, e2, e1 + (e2 - e1) / (r2 - r1) * (FULL_ROWS - r1))  # timing noise never shrinks it
    base = results[0]["seconds"]
    needs = calibration_needs(cfg, rows, cols, settings)
    full = calibration_needs(cfg, FULL_ROWS, cols, settings)
    per_layer = results[1]["seconds"] * FULL_ROWS / rows + experts_full + finish[results[1]["mode"]]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": config, "layer": args.layer, "rows": rows, "cols": cols,
        "results": results, "finish_seconds": finish,
        "expert_hessians_seconds": {str(r): v for r, v in experts.items()} | {str(FULL_ROWS): experts_full},
        "estimate_gib": {"this_run_layer_part": (needs.stream.weights + needs.stream.activations + needs.hessians
                                                 + needs.extras) / 2**30,
                         "full_run_device": full.device / 2**30, "full_run_disk": full.disk / 2**30},
        "projected_layer_seconds_at_250_rows": per_layer,
        "projected_model_hours_at_250_rows": per_layer * cfg.num_layers / 3600,
    }
    print(f"{report['device']}  layer {args.layer}  {rows} x {cols} tokens  {str(dtype).replace('torch.', '')}")
    print(table(["mode", "s", "x plain", "peak GiB"],
                [[r["mode"], f"{r['seconds']:.2f}", f"{r['seconds'] / base:.2f}", f"{r.get('peak_gib', 0):.1f}"]
                 for r in results]))
    print("experts' own Hessians: " + ", ".join(f"{r} rows {v:.2f} s" for r, v in experts.items())
          + f", {FULL_ROWS} rows {experts_full:.1f} s (extrapolated linearly in the rows, never below what was measured)")
    print("finish: " + ", ".join(f"{k} {v:.2f} s" for k, v in finish.items()))
    print(f"estimated peak for this run's layer work {report['estimate_gib']['this_run_layer_part']:.1f} GiB "
          f"(streams of the rows not included); full run {report['estimate_gib']['full_run_device']:.1f} GiB device, "
          f"{report['estimate_gib']['full_run_disk']:.1f} GiB disk")
    print(f"projected at {FULL_ROWS} rows: {per_layer:.0f} s per layer, "
          f"{report['projected_model_hours_at_250_rows']:.2f} h for {cfg.num_layers} layers "
          "(resume writes not included)")
    out_dir = os.environ.get("OUT")
    if out_dir:
        (Path(out_dir) / "calibrate_gpu_layer.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
