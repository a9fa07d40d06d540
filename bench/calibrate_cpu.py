"""The calibrate stage's rate on the CPU: whole `calibrate` runs of the bundled small model, timed, against
the estimates printed before calibrating and before its unit KL probe (calibrate/duration.py,
configs/calibrate_rates/cpu.json).

Each row count runs in a fresh work directory (nothing reused), on the shipped calibration text. The
reference is the run itself, timed in two parts: the pass over the rows and the unit KL probe
(`CalibrationResult.unit_kl_seconds`). The ratios printed are estimate / measured, for the whole run and
for the probe alone, each of which must stay within 25% (0.8 to 1.25). The process's CPU time is printed
beside the wall time. Run it on idle cores: on shared ones the probe's time alone varied tenfold (10 to
145 s on the same 8 x 512 tokens): its many small operations wait on each other's threads. Each part's
rate is fitted (least squares on seconds = FLOPs / rate) and written to $OUT/calibrate_rates.json in the
table's format.

    python bench/calibrate_cpu.py                          # 4 and 16 rows of 2048 tokens, 2 threads
    python bench/calibrate_cpu.py --rows 8                 # the README's bundled build (--calib-rows 8)
    python bench/calibrate_cpu.py --rows 37 --cols 2048    # what `build` of the bundled model uses
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.calibrate.duration import RATES_FORMAT, CalibrationRate, calibration_flops  # noqa: E402
from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.calibrate.stage import calibrate  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402
from quantizer.textdata import model_rows, shipped_text_path  # noqa: E402

TOLERANCE = 1.25  # every printed estimate within 25% of the measurement (docs/ARCHITECTURE.md, benches)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="4,16", help="comma-separated row counts, each a run of its own")
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the shipped rate's: 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ck = Checkpoint.open(shipped("small_model"))
    counts = [int(n) for n in args.rows.split(",")]
    text = model_rows(ck.root, ck.config, text=shipped_text_path("calibration"), rows=max(counts), cols=args.cols,
                      default_cols=args.cols)
    settings = CalibrationSettings(device="cpu")
    shipped_rate = CalibrationRate.load("cpu")
    runs = []
    for n in counts:
        rows = text[:n]
        with tempfile.TemporaryDirectory(prefix="calibrate-bench-") as work:
            cpu = time.process_time()
            result = calibrate(ck, rows, work, settings, progress=False)
            cpu = time.process_time() - cpu
        flops = calibration_flops(ck.config, *rows.shape, settings)
        estimate = shipped_rate.seconds(flops) if shipped_rate else None
        probe = flops[1] / shipped_rate.probe_flops_per_s if shipped_rate and flops[1] else None
        runs.append({"rows": int(rows.shape[0]), "cols": int(rows.shape[1]), "seconds": result.seconds,
                     "probe_seconds": result.unit_kl_seconds, "cpu_seconds": cpu,
                     "pass_flops": flops[0], "probe_flops": flops[1], "estimate": estimate, "probe_estimate": probe,
                     "ratio": None if estimate is None else estimate / result.seconds,
                     "probe_ratio": None if probe is None else probe / result.unit_kl_seconds})
    print(f"bundled small model ({ck.root.name}) on the CPU, {args.threads} threads")
    print(table(["rows", "cols", "measured s", "of it unit KL s", "CPU s (all threads)", "estimate s",
                 "unit KL estimate s", "estimate / measured", "unit KL estimate / measured"],
                [[r["rows"], r["cols"], f"{r['seconds']:.1f}", f"{r['probe_seconds']:.1f}", f"{r['cpu_seconds']:.1f}",
                  _number(r["estimate"], 1), _number(r["probe_estimate"], 1), _number(r["ratio"], 2),
                  _number(r["probe_ratio"], 2)] for r in runs]))
    report = {"threads": args.threads, "runs": runs, "fitted": fit(runs, args.threads)}
    if report["fitted"]:
        print(json.dumps(report["fitted"], indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "calibrate_rates.json").write_text(json.dumps(report["fitted"], indent=1) + "\n")
    bad = [r for r in runs if any(x is not None and not 1 / TOLERANCE <= x <= TOLERANCE
                                  for x in (r["ratio"], r["probe_ratio"]))]
    if bad:
        print(f"estimate off by more than 25% at {', '.join(str(r['rows']) for r in bad)} rows", file=sys.stderr)
    return report


def _number(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fit(runs: list[dict], threads: int) -> dict | None:
    """The pass's and the probe's rates, each from its own measured seconds (least squares of seconds =
    FLOPs / rate, no intercept); None where no run measured the probe."""
    probed = [r for r in runs if r["probe_flops"]]
    if not probed:
        return None

    def rate(pairs: list[tuple[float, float]]) -> float:
        return sum(f * f for f, _ in pairs) / sum(f * s for f, s in pairs)

    return {"format": RATES_FORMAT, "version": 1, "device": f"{threads} CPU threads",
            "pass_flops_per_s": rate([(r["pass_flops"], r["seconds"] - r["probe_seconds"]) for r in runs]),
            "probe_flops_per_s": rate([(r["probe_flops"], r["probe_seconds"]) for r in probed]),
            "measured_by": "bench/calibrate_cpu.py",
            "source": ", ".join(f"{r['rows']} x {r['cols']}: {r['seconds']:.1f} s (unit KL probe {r['probe_seconds']:.1f} s)"
                                for r in runs)}


if __name__ == "__main__":
    main()
