"""`quantizer demo [--model small-v4] [--json]`: a bundled small model built at 2.5, 2.9 and 3.5 bpw by four methods."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from quantizer.commands.arguments import out_dir
from quantizer.demo.sweep import (
    demo_loaders,
    KNOWN_METHODS,
    METHODS,
    MODELS,
    SIZES,
    DemoResult,
    DemoRow,
    DemoSettings,
    as_json_rows,
    run_demo,
)
from quantizer.plots import plot_path, save_figure
from quantizer.report import table
from quantizer.textdata import SET_FILES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the bundled small model at several sizes and methods; print size, fit, quality")
    p.add_argument("--model", default=DemoSettings.model,
                   help=f"the bundled model: {' or '.join(MODELS)} (default {DemoSettings.model}; small-v4 is the "
                        "DeepSeek-V4 architecture, which stock exllamav3 runs)")
    p.add_argument("--json", action="store_true",
                   help="print a list of rows (bpw, method, bytes, ppl, kl, top1, ...) as JSON")
    p.add_argument("--work", type=out_dir, help="keep the work (calibration, encodings, packs) here and resume from it "
                                             "(default: a temporary directory, deleted at the end)")
    p.add_argument("--sizes", type=_floats, default=SIZES, help="comma-separated bpw (default 2.5,2.9,3.5)")
    p.add_argument("--methods", type=lambda s: tuple(s.split(",")), default=METHODS,
                   help=f"comma-separated, from {','.join(KNOWN_METHODS)} (default {','.join(METHODS)}; ours-tuned: "
                        "ours with build --tune)")
    p.add_argument("--loader", type=lambda s: tuple(s.split(",")), default=demo_loaders(),
                   help=f"comma-separated loader profiles our allocator plans for (default {','.join(demo_loaders())}); "
                        "uniform and exl3 plans are made for exllamav3")
    p.add_argument("--eval-rows", type=int, default=DemoSettings.eval_rows, help="held-out rows of 512 tokens")
    p.add_argument("--eval-text", default=DemoSettings.eval_text, metavar="SET|FILE",
                   help=f"the text the packs are measured on: a shipped set ({', '.join(SET_FILES)}) or a file "
                        f"(default {DemoSettings.eval_text}; heldout-tests is held-out text of another kind than "
                        "calibration)")
    p.add_argument("--plot", help="also draw KL and top-1 against bits per method to FILE.png (the plots extra)")
    p.set_defaults(func=run)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def run(args: argparse.Namespace) -> int:
    plot = plot_path(args.plot) if args.plot else None
    settings = DemoSettings(sizes=args.sizes, methods=args.methods, loaders=args.loader, model=args.model,
                            eval_rows=args.eval_rows, eval_text=args.eval_text)
    if args.work:
        result = run_demo(args.work, settings)
    else:
        work = Path(tempfile.mkdtemp(prefix="quantizer-demo-"))
        try:
            result = run_demo(work, settings)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(as_json_rows(result), indent=1) if args.json else render(result))
    if plot:
        from quantizer.plots.quality import quality_figure

        save_figure(quality_figure(as_json_rows(result)), plot)
    return 0 if all(r.verified for r in result.rows) else 1


def _one_spark(r: DemoRow) -> str:
    """The 1 Spark column: the weights there and whether it fits, or that the pack's engine needs more Sparks."""
    if r.weights_gib is None:
        return "engine needs 2+"
    return f"{r.weights_gib:.3f} GiB, {'fits' if r.fits_1_spark else 'no'}"


def render(result: DemoResult) -> str:
    rows = [[f"{r.bpw:g}", r.method, r.loader, f"{r.achieved_bpw:.3f}", f"{r.bytes:,}", f"{r.ppl:.3f}",
             f"{r.kl:.4f} ± {r.kl_stderr:.4f}", f"{r.top1:.2%}", f"{r.nll_delta:+.4f} ± {r.nll_delta_stderr:.4f}",
             "ok" if r.verified else "FAULT", _one_spark(r)] for r in result.rows]
    head = ["bpw", "method", "loader", "achieved", "bytes", "ppl", "KL", "top-1", "NLL delta", "verify", "1 Spark"]
    return "\n".join([
        f"native (FP8/FP4) perplexity {result.native_ppl:.3f} over {result.tokens:,} held-out tokens"
        f"{'' if result.eval_text == DemoSettings.eval_text else f' of {result.eval_text}'}; {result.seconds / 60:.1f} min",
        table(head, rows, right=set(range(3, len(head)))),
    ])
