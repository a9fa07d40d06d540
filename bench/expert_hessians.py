"""What routing-weighted expert Hessians change: KL, top-1 and perplexity of packs of the bundled small
V4.1 model against the native model on held-out text, each weighting against the default.

For each --expert-hessians setting (calibrate/settings.py, docs/calibration.md) the model is calibrated
and built in a work directory of its own, by each method at each size, for the exllamav3 loader
profile, on the CPU with our codec. The default (`gate2` since 2026-12-03; `shared`, against which
docs/calibration.md's tables were measured, before) is built first and plans each
(method, size); every other weighting is built with that same plan (`build --plan`), so each pair of
packs holds exactly the same bytes and differs only in the Hessians the encoder saw. The trellis
search is chaotic (any change of H moves its path), so the default is also rebuilt with another job seed
(--noise-seed): its ratio is the noise floor a weighting's ratio is judged against. Ratios are
against the default at its default seed, in the same run; each pack's numbers are also printed as a
JSON line as soon as it is measured. With 16 x 512 calibration tokens and 4 held-out rows, the four
weightings, two methods and two sizes took about 80 minutes on 2 cores shared with other jobs (the
default calibration's unit-KL measurement, which `ours` plans on, about 12 of them; --no-measure-kl
plans on stream-energy site gains instead, as for the real model):

    python bench/expert_hessians.py [--calib-rows 16] [--cols 512] [--eval-rows 4] [--eval-text SET ...] [--json OUT]

--eval-text names the texts every pack is measured on (shipped sets or files, default the shipped
`heldout`; `--eval-text heldout heldout-tests` adds held-out text of another kind than calibration, so
a gain is seen on both with the same packs); calibration stays the shipped calibration set.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.orchestrate.stages import BuildRequest, build  # noqa: E402
from quantizer.calibrate.settings import EXPERT_HESSIANS, CalibrationSettings  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile  # noqa: E402
from quantizer.model.streaming import CheckpointSource, LayerStreamer  # noqa: E402
from quantizer.plan.allocate import AllocationSettings  # noqa: E402
from quantizer.ppl.compare import compare  # noqa: E402
from quantizer.ppl.pack_source import PackSource  # noqa: E402
from quantizer.ppl.perplexity import row_predictions  # noqa: E402
from quantizer.quantize.settings import QuantizeSettings  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402
from quantizer.textdata import SET_FILES, model_rows, shipped_text_path, text_argument  # noqa: E402

DEFAULT = CalibrationSettings().expert_hessians


def _streamer(source) -> LayerStreamer:
    return LayerStreamer(source, progress=False, report=lambda line: None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calib-rows", type=int, default=16)
    p.add_argument("--eval-rows", type=int, default=4)
    p.add_argument("--eval-text", nargs="+", default=["heldout"],
                   help=f"the texts each pack is measured on: shipped sets ({', '.join(SET_FILES)}) or files "
                        "(default heldout)")
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--sizes", type=float, nargs="+", default=[2.5, 2.9])
    p.add_argument("--methods", nargs="+", default=["ours", "uniform"])
    p.add_argument("--hessians", nargs="+", default=list(EXPERT_HESSIANS), help="weightings to compare")
    p.add_argument("--noise-seed", type=int, default=1, help="job seed of the noise-floor rebuild (-1: none)")
    p.add_argument("--measure-kl", action=argparse.BooleanOptionalAction, default=None,
                   help="the default calibration's unit KL for ours (default: measured, the model fits in memory; "
                        "--no-measure-kl plans on stream-energy site gains, as for the real model)")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    eval_texts = {name: text_argument(name) for name in args.eval_text}
    variants = [(DEFAULT, 0)] + [(h, 0) for h in args.hessians if h != DEFAULT]
    if args.noise_seed >= 0:
        variants.append((DEFAULT, args.noise_seed))
    ck = Checkpoint.open(shipped("small_model"))

    def rows(text: Path, count: int):
        return model_rows(ck.root, ck.config, text=text, rows=count, cols=args.cols, default_cols=args.cols)

    start = time.monotonic()
    calibration = rows(shipped_text_path("calibration"), args.calib_rows)
    held = {name: rows(text, args.eval_rows) for name, text in eval_texts.items()}
    reference = {name: list(row_predictions(_streamer(CheckpointSource(ck)), r)) for name, r in held.items()}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        plans, results = {}, []
        for hessians, seed in variants:
            name = hessians if seed == 0 else f"{hessians} seed {seed}"
            for method in args.methods:
                for size in args.sizes:
                    plan = plans.get((method, size))
                    out = work / name.replace(" ", "-") / f"{size:g}-{method}"
                    shutil.rmtree(out, ignore_errors=True)
                    print(f"bench: {name}, {method} at {size:g} bpw", file=sys.stderr, flush=True)
                    built = build(BuildRequest(
                        src=str(ck.root), out=out, bpw=None if plan else size, plan=plan, method=method,
                        allocation=AllocationSettings(profile=load_profile(EXLLAMAV3)), calibration_rows=calibration,
                        calibration_settings=CalibrationSettings(device="cpu", expert_hessians=hessians,
                                                        measure_kl=args.measure_kl if plan is None else False),
                        work=out.parent / "build", quantize=QuantizeSettings(seed=seed, device="cpu")))
                    plans.setdefault((method, size), built.plan)
                    for text, rows_ in held.items():
                        c = compare(reference[text], row_predictions(_streamer(PackSource(Checkpoint.open(out))), rows_))
                        results.append({"hessians": name, "method": method, "bpw": size, "eval_text": text,
                                        "bytes": sum(s.bytes for s in built.manifest.shards), "kl": c.kl,
                                        "kl_stderr": c.kl_stderr, "top1": c.top1, "ppl": c.pack.ppl,
                                        "native_ppl": c.source.ppl})
                        print(json.dumps(results[-1]), flush=True)  # each pack as it is measured
    base = {(r["eval_text"], r["method"], r["bpw"]): r for r in results if r["hessians"] == DEFAULT}
    lines = []
    for r in sorted(results, key=lambda r: (args.eval_text.index(r["eval_text"]), r["bpw"], r["method"])):
        b = base[r["eval_text"], r["method"], r["bpw"]]
        lines.append([r["eval_text"], f"{r['bpw']:g}", r["method"], r["hessians"], f"{r['bytes']:,}",
                      f"{r['kl']:.4f} ± {r['kl_stderr']:.4f}", f"{r['kl'] / b['kl']:.3f}", f"{r['top1']:.4f}",
                      f"{r['top1'] - b['top1']:+.4f}", f"{r['ppl']:.3f}", f"{r['ppl'] / b['ppl']:.4f}"])
    print(table(["eval text", "bpw", "method", "expert Hessians", "pack bytes", "KL", "KL / shared", "top-1",
                 "top-1 - shared", "ppl", "ppl / shared"], lines))
    natives = {r["eval_text"]: r["native_ppl"] for r in results}
    print(f"native ppl {', '.join(f'{v:.3f} on {k}' for k, v in natives.items())}; {args.calib_rows} x {args.cols} "
          f"calibration tokens, {args.eval_rows} x {args.cols} held-out; {time.monotonic() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
