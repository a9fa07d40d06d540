"""The calibrate stage's rate on the CPU: whole `calibrate` runs of the bundled small model, timed, against
the estimate `build` prints before calibrating (calibrate/duration.py, configs/calibrate_rates/cpu.json).

Each row count runs in a fresh work directory (nothing reused), on the shipped calibration text. The
reference is the run itself: the ratio printed is estimate / measured, which must stay within 25%
(0.8 to 1.25). The process's CPU time is printed beside the wall time. Run it on idle cores: on shared
ones the probe's time alone varied tenfold (10 to 145 s on the same 8 x 512 tokens). With two or more
row counts the two rates are fitted (least squares on seconds = pass FLOPs / pass rate + probe FLOPs /
probe rate) and written to $OUT/calibrate_rates.json in the table's format.

    python bench/calibrate_cpu.py                          # 4 and 16 rows of 2048 tokens, 2 threads
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
            start, cpu = time.monotonic(), time.process_time()
            calibrate(ck, rows, work, settings, progress=False)
            seconds, cpu = time.monotonic() - start, time.process_time() - cpu
        flops = calibration_flops(ck.config, *rows.shape, settings)
        estimate = shipped_rate.seconds(flops) if shipped_rate else None
        runs.append({"rows": int(rows.shape[0]), "cols": int(rows.shape[1]), "seconds": seconds, "cpu_seconds": cpu,
                     "pass_flops": flops[0], "probe_flops": flops[1], "estimate": estimate,
                     "ratio": None if estimate is None else estimate / seconds})
    print(f"bundled small model ({ck.root.name}) on the CPU, {args.threads} threads")
    print(table(["rows", "cols", "measured s", "CPU s (all threads)", "estimate s", "estimate / measured"],
                [[r["rows"], r["cols"], f"{r['seconds']:.1f}", f"{r['cpu_seconds']:.1f}",
                  "-" if r["estimate"] is None else f"{r['estimate']:.1f}",
                  "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in runs]))
    report = {"threads": args.threads, "runs": runs, "fitted": fit(runs, args.threads)}
    if report["fitted"]:
        print(json.dumps(report["fitted"], indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "calibrate_rates.json").write_text(json.dumps(report["fitted"], indent=1) + "\n")
    bad = [r for r in runs if r["ratio"] is not None and not 1 / TOLERANCE <= r["ratio"] <= TOLERANCE]
    if bad:
        print(f"estimate off by more than 25% at {', '.join(str(r['rows']) for r in bad)} rows", file=sys.stderr)
    return report


def fit(runs: list[dict], threads: int) -> dict | None:
    """The (pass, probe) rates that best give the runs' seconds (least squares, no intercept); None where
    the runs do not tell the two apart."""
    a = [[r["pass_flops"], r["probe_flops"]] for r in runs]
    ata = [[sum(row[i] * row[j] for row in a) for j in range(2)] for i in range(2)]
    atb = [sum(row[i] * r["seconds"] for row, r in zip(a, runs)) for i in range(2)]
    det = ata[0][0] * ata[1][1] - ata[0][1] * ata[1][0]
    if abs(det) < 1e-12 * ata[0][0] * ata[1][1] or not ata[1][1]:
        return None
    per_pass = (atb[0] * ata[1][1] - atb[1] * ata[0][1]) / det
    per_probe = (ata[0][0] * atb[1] - ata[1][0] * atb[0]) / det
    if min(per_pass, per_probe) <= 0:
        return None
    return {"format": RATES_FORMAT, "version": 1, "device": f"{threads} CPU threads",
            "pass_flops_per_s": 1 / per_pass, "probe_flops_per_s": 1 / per_probe,
            "measured_by": "bench/calibrate_cpu.py",
            "source": ", ".join(f"{r['rows']} x {r['cols']}: {r['seconds']:.1f} s" for r in runs)}


if __name__ == "__main__":
    main()
