"""Our builds against exllamav3's own converter along the bits axis, measured in stock exllamav3 (GPU).

On a bundled small V4 model (the architecture stock exllamav3 1.6.5 runs; --model, default the 8-expert
`small_model_v4`, or `small_model_v4_moe64`, 64 experts routed top-6): the converter
(`python -m exllamav3.conversion.convert_model`, its defaults, our calibration rows) at every bpw of
--steps, and at each of --sizes our `quantizer build` at the converter's own bits there (equal bytes of
the budgeted linears), once per --variants entry (a size between the converter's steps is built at that
bpw itself and set against the converter's best pack of at most that many bits): `ours` (the defaults,
whose routed experts' Hessians are `gate2` since 2026-12-03, docs/calibration.md), `tune` (+ `--tune`, block-wise suh/svh,
docs/tuning.md), `e2e` (+ `--tune-e2e`, every scale fitted to the native logits), `shared` (+
`--expert-hessians shared`, the previous default: every routed expert's gate/up on the layer's
all-token input), and their combinations joined by `+` (VARIANTS). Every pack is loaded by exllamav3
and compared with the native model's exllamav3 logits on each --eval-text: KL, top-1 agreement,
perplexity.

The reference is the converter's curve measured in the same run: for each of our packs, the ratio of its
KL to the converter's at the same bits, and `bits_equiv`, the bits at which the converter reaches that
KL (log KL interpolated linearly between its steps; `>` past the last step). `gain` = bits_equiv minus
our bits: how many bits per weight our pack saves against the converter at equal quality.

    python bench/converter_curve.py [--model small_model_v4_moe64] [--sizes 2,2.5,3,3.5] [--steps 2:4:0.25]
                                    [--variants ours,tune,shared] [--eval-text heldout,heldout-tests] [--json OUT]
                                    [--work DIR]

Rows are printed as they are measured and written to --json then, so a run cut short keeps what it measured.
A --work directory of an earlier run on the same model and calibration is reused: its converter packs are
measured again, not rebuilt (about 50 s each), and our builds resume from their work directories (only
encodings no earlier build made are made).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.orchestrate.stages import plan_files
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main as quantizer
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.ppl.compare import compare
from quantizer.ppl.exllamav3_engine import budgeted_bytes, exllamav3_predictions, stored_bpw
from quantizer.report import table
from quantizer.shipped import shipped
from quantizer.textdata import model_rows, shipped_text_path, text_argument

# variant -> (build flags, work directory group): the tuned variants share their untuned variant's work
# directory (one calibration, the same codes and bytes); shared calibrates differently, so it has its own.
SHARED = ["--expert-hessians", "shared"]
VARIANTS = {"ours": ([], "ours"), "tune": (["--tune"], "ours"), "e2e": (["--tune-e2e"], "ours"),
            "tune+e2e": (["--tune", "--tune-e2e"], "ours"), "shared": (SHARED, "shared"),
            "shared+tune": ([*SHARED, "--tune"], "shared"), "shared+tune+e2e": ([*SHARED, "--tune", "--tune-e2e"], "shared")}
CALIB_COLS = 2048
CALIBRATION_FILE = "cal.safetensors"  # the rows the converter reads, in --work
DONE = "converter-done"  # written into a converter pack once exllamav3's converter has finished it


def best_of(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The steps no fewer-bits step beats: a converter user at b bits takes the best pack of at most b bits.
    (On the 64-expert model the converter's 2.5, 3.0 and 3.5 bpw packs have more KL than its 2.25, 2.75
    and 3.25 ones; interpolating through them would credit our packs with bits the converter never needs.)"""
    kept: list[tuple[float, float]] = []
    for bits, kl in curve:
        if not kept or kl < kept[-1][1]:
            kept.append((bits, kl))
    return kept


def bits_equiv(kl: float, curve: list[tuple[float, float]]) -> tuple[float, str]:
    """The bits at which the converter's (bits, KL) curve first reaches `kl`: log KL is interpolated linearly
    between the steps of `best_of(curve)`. ('<' or '>', the end) outside the measured range."""
    curve = best_of(curve)
    if kl >= curve[0][1]:
        return curve[0][0], "<"
    for (b0, k0), (b1, k1) in zip(curve, curve[1:]):
        if k1 <= kl <= k0:
            t = (math.log(k0) - math.log(kl)) / (math.log(k0) - math.log(k1)) if k0 != k1 else 0.0
            return b0 + t * (b1 - b0), ""
    return curve[-1][0], ">"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("small_model_v4", "small_model_v4_moe64"), default="small_model_v4",
                    help="the bundled V4-architecture model (default %(default)s)")
    ap.add_argument("--sizes", default="2,2.5,3,3.5",
                    help="comma-separated bpw of our builds: at a step, the converter's own bits there; between steps, "
                         "that bpw (set against the converter's best pack of at most that many bits)")
    ap.add_argument("--steps", default="2:4:0.25", help="converter bpw, START:STOP:STEP (STOP included)")
    ap.add_argument("--variants", default="ours,tune,shared", help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--eval-text", default="heldout,heldout-tests", help="comma-separated texts to measure on")
    ap.add_argument("--eval-rows", type=int, default=16)
    ap.add_argument("--eval-cols", type=int, default=512)
    ap.add_argument("--work", type=Path, help="keep packs here: a new or empty directory, or an earlier run's, which "
                                              "is reused (default: a temporary directory, deleted at the end)")
    ap.add_argument("--json", type=Path, help="write each measured row to this file as it is measured (JSON lines)")
    args = ap.parse_args(argv)
    try:
        start, stop, step = (float(x) for x in args.steps.split(":"))
    except ValueError:
        ap.error(f"--steps {args.steps!r}: give START:STOP:STEP, e.g. 2:4:0.25")
    if not (0 < step and start <= stop):
        ap.error(f"--steps {args.steps!r}: STEP must be positive and START at most STOP")
    steps = [round(start + i * step, 4) for i in range(int(round((stop - start) / step)) + 1)]
    try:
        sizes = [float(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: give comma-separated bpw, e.g. 2,2.5")
    if min(sizes) < steps[0]:
        ap.error(f"--sizes {args.sizes}: each size must be at least the converter's first step {steps[0]:g}")
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    if args.work and args.work.exists() and any(args.work.iterdir()) and not (args.work / CALIBRATION_FILE).is_file():
        ap.error(f"--work {args.work} holds no earlier run of this bench (no {CALIBRATION_FILE}): its files would "
                 "be in the way")
    if args.json and not args.json.parent.is_dir():
        ap.error(f"--json {args.json}: no directory {args.json.parent}")
    if not torch.cuda.is_available() or importlib.util.find_spec("exllamav3") is None:
        ap.error("needs a CUDA device and exllamav3 (the gpu extra)")
    if args.json:
        args.json.write_text("")
    root = args.work or Path(tempfile.mkdtemp(prefix="converter-curve-"))
    try:
        measured = run(args, root, steps, sizes, variants)
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)
    report(measured, steps)


def reuse_converter(root: Path, model: str, calibration: torch.Tensor) -> None:
    """Write the calibration rows the converter reads, or check that an earlier run's in --work are these
    (same model, same rows): its packs are only reused then."""
    path, record = root / CALIBRATION_FILE, {"model": model}
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                same = f.metadata() == record and torch.equal(f.get_tensor("input_ids"), calibration)
        except (OSError, SafetensorError, KeyError) as e:  # truncated, not safetensors, or without the rows
            raise UserError(f"{path}: unreadable ({e}); give an empty --work") from None
        if not same:
            raise UserError(f"{root}: an earlier run on another model or other calibration rows; give an empty --work")
        return
    partial = path.with_name(path.name + ".tmp")  # renamed once whole: a killed run leaves no half file
    save_file({"input_ids": calibration}, str(partial), metadata=record)
    partial.replace(path)


def run(args: argparse.Namespace, root: Path, steps: list[float], sizes: list[float], variants: list[str]) -> list[dict]:
    """Build and measure every pack; the measured rows."""
    model = shipped(args.model)
    ck = Checkpoint.open(model)
    root.mkdir(parents=True, exist_ok=True)
    calibration = model_rows(ck.root, ck.config, text=shipped_text_path("calibration"), rows=None, cols=CALIB_COLS,
                             default_cols=CALIB_COLS).to(torch.long).contiguous()
    reuse_converter(root, args.model, calibration)
    texts = {name: model_rows(ck.root, ck.config, text=text_argument(name), rows=args.eval_rows, cols=args.eval_cols,
                              default_cols=args.eval_cols) for name in args.eval_text.split(",")}
    native = {name: exllamav3_predictions(model, rows) for name, rows in texts.items()}
    measured: list[dict] = []

    def record(method: str, size: float, pack: Path, bits: float, seconds: float) -> None:
        for name, rows in texts.items():
            c = compare(native[name], exllamav3_predictions(pack, rows))
            row = {"method": method, "size": size, "bits": bits, "text": name, "kl": c.kl, "kl_stderr": c.kl_stderr,
                   "top1": c.top1, "ppl": c.pack.ppl, "ppl_native": c.source.ppl,
                   "budgeted_bytes": budgeted_bytes(pack), "seconds": seconds}
            measured.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(row) + "\n")

    converter_bits = {}
    for bpw in steps:
        pack, t0 = root / f"exl3-{bpw:g}", time.monotonic()
        if not (pack / DONE).is_file():  # an earlier run's finished pack is measured again, not rebuilt
            shutil.rmtree(pack, ignore_errors=True)
            shutil.rmtree(root / f"exl3-{bpw:g}.work", ignore_errors=True)
            subprocess.run([sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(model), "-o",
                            str(pack), "-w", str(root / f"exl3-{bpw:g}.work"), "-b", str(bpw), "-cd",
                            str(root / CALIBRATION_FILE), "-cr", str(len(calibration)), "-cc", str(CALIB_COLS)],
                           check=True, stdout=subprocess.DEVNULL)
            (pack / DONE).write_text(f"{bpw:g}\n")
        converter_bits[bpw] = stored_bpw(pack, ck.config)
        record("converter", bpw, pack, converter_bits[bpw], time.monotonic() - t0)
    for variant in variants:  # every size of one variant before the next: a run cut short keeps whole curves
        for size in sizes:
            flags, group = VARIANTS[variant]
            pack, work, t0 = root / f"{variant}-{size:g}", root / f"{group}-{size:g}.work", time.monotonic()
            shutil.rmtree(pack, ignore_errors=True)  # an earlier run's: rebuilt from its work directory's cache
            if quantizer(["build", str(model), "--out", str(pack), "--device", "cuda", "--work", str(work),
                          "--bpw", f"{converter_bits.get(size, size):.6f}", *flags]) != 0:
                raise UserError(f"the build of {variant} at {size:g} bpw failed (its error is above)")
            bits = Plan.load(plan_files(work, pack)[0]).achieved_bpw
            record(variant, size, pack, bits, time.monotonic() - t0)
    return measured


def reference_step(size: float, steps: list[float]) -> float:
    """The converter step a size of ours is set against: the size itself, or the largest step below it."""
    return max(b for b in steps if b <= size)


def report(measured: list[dict], steps: list[float]) -> None:
    """Per text: each of our packs against the converter's curve."""
    for name in dict.fromkeys(r["text"] for r in measured):
        rows = [r for r in measured if r["text"] == name]
        conv = {r["size"]: r for r in rows if r["method"] == "converter"}
        curve = [(conv[b]["bits"], conv[b]["kl"]) for b in steps if b in conv]
        out = []
        for r in rows:
            if r["method"] == "converter":
                continue
            c = conv[reference_step(r["size"], steps)]
            equiv, side = bits_equiv(r["kl"], curve)
            out.append([r["method"], f"{r['size']:g}", f"{r['bits']:.3f}", f"{r['kl']:.4f}", f"{c['kl']:.4f}",
                        f"{r['kl'] / c['kl']:.3f}", f"{side}{equiv:.2f}", f"{side}{equiv - r['bits']:+.2f}",
                        f"{r['top1']:.2%}", f"{c['top1']:.2%}", f"{r['ppl']:.3f}", f"{c['ppl']:.3f}",
                        f"{r['budgeted_bytes'] / c['budgeted_bytes']:.4f}"])
        print(f"\n{name}: native ppl {rows[0]['ppl_native']:.3f}; converter curve "
              + ", ".join(f"{b:.2f}:{k:.4f}" for b, k in curve))
        print(table(["method", "size", "bits", "KL", "KL conv", "ratio", "bits_equiv", "gain", "top1", "top1 conv",
                     "ppl", "ppl conv", "bytes ratio"], out))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # an unknown --eval-text, a failed build: one line, exit 2
        print(f"converter_curve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
