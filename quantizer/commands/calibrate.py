"""`quantizer calibrate SRC [--text FILE | --tokens FILE] [--rows R --cols C] [--work DIR] [--device cpu|cuda]
[--expert-hessians shared|gate2|gate|count] [--measure-kl/--no-measure-kl] [--kl-rows N --kl-cols C]`

Without --text or --tokens, the shipped calibration set (calibration/calibration.jsonl) is tokenized
with SRC's tokenizer.json. Text gets one BOS per row and EOS between documents; token files (.npy,
or .safetensors with `input_ids`) are used as given (1-D: cut into rows of --cols; 2-D: taken as rows).
Rerun the same command after an interruption and it continues from the next layer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantizer.calibrate.rows import calibration_rows
from quantizer.calibrate.settings import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    EXPERT_HESSIAN_DTYPES,
    CalibrationSettings,
)
from quantizer.calibrate.stage import CalibrationResult, calibrate
from quantizer.calibrate.summary import KL_UNITS, MEASURED_KL
from quantizer.checkpoint.source import Checkpoint
from quantizer.commands.arguments import add_device_argument, add_expert_hessians, out_dir, revision
from quantizer.inventory.classify import require_consistent
from quantizer.report import table

DEFAULTS = CalibrationSettings()


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="input Hessians, routing counts and the allocator's summary",
                              description=__doc__.splitlines()[0])
    p.add_argument("src", metavar="SRC", help="native checkpoint directory or Hugging Face repo id")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--text", metavar="FILE", help="text (.txt, .jsonl, optionally .zst) or a shipped set's name "
                       "(default: calibration), tokenized with SRC's tokenizer.json")
    given.add_argument("--tokens", metavar="FILE", help="token ids: .npy, or .safetensors with key input_ids (1-D or 2-D)")
    p.add_argument("--rows", type=int, help=f"rows to use (default: up to {DEFAULT_ROWS}, as many as the text holds)")
    p.add_argument("--cols", type=int, help=f"tokens per row (default: a 2-D token file's width, else {DEFAULT_COLS})")
    p.add_argument("--work", type=out_dir, help="work directory (default: ./<SRC name>.work); results go to WORK/calibration")
    add_device_argument(p, "where the model runs: cpu in float32, cuda in bfloat16; the Hessians accumulate in "
                           "float32 on either")
    p.add_argument("--all-experts", action=argparse.BooleanOptionalAction, default=DEFAULTS.all_experts,
                   help="run every token through every routed expert for the experts' down-projection prior "
                        "(default on; off samples the prior from a few thousand tokens instead)")
    p.add_argument("--prior-tokens", type=float, default=DEFAULTS.prior_tokens,
                   help="weight, in routed tokens, of the all-token prior in each expert's down-projection H "
                        f"(default {DEFAULTS.prior_tokens:g}; 0 = routed tokens only)")
    add_expert_hessians(p)
    p.add_argument("--row-chunk", type=int, help="rows pushed through a block together (default: 16384 tokens' worth)")
    p.add_argument("--expert-hessian-dtype", choices=EXPERT_HESSIAN_DTYPES, default=DEFAULTS.expert_hessian_dtype,
                   help="storage of the routed experts' down-projection Hessians (others are float32)")
    p.add_argument("--cold-share", type=float, default=DEFAULTS.cold_share,
                   help="an expert routed below this share of the layer's mean is cold "
                        f"(default {DEFAULTS.cold_share:g})")
    p.add_argument("--measure-kl", action=argparse.BooleanOptionalAction, default=DEFAULTS.measure_kl,
                   help="measure each layer unit's KL by noise injection for the allocator (default: when the "
                        "dequantized model fits in memory; the real V4.1-Flash does not, its summary keeps "
                        "stream-energy site gains)")
    p.add_argument("--kl-rows", type=int, default=DEFAULTS.kl_rows,
                   help=f"calibration rows of the KL measurement (default {DEFAULTS.kl_rows}, evenly spaced)")
    p.add_argument("--kl-cols", type=int, default=DEFAULTS.kl_cols,
                   help=f"tokens per row of the KL measurement (default {DEFAULTS.kl_cols})")
    p.add_argument("--resume-every", type=int, default=1, metavar="N",
                   help="save the resume point (every row's hc streams and state) every N layers (default 1)")
    p.add_argument("--revision", type=revision, help="revision, for a Hugging Face repo id")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = CalibrationSettings(device=args.device, all_experts=args.all_experts, prior_tokens=args.prior_tokens,
                                   row_chunk=args.row_chunk, expert_hessian_dtype=args.expert_hessian_dtype,
                                   expert_hessians=args.expert_hessians,
                                   cold_share=args.cold_share, measure_kl=args.measure_kl, kl_rows=args.kl_rows,
                                   kl_cols=args.kl_cols)
    ck = Checkpoint.open(args.src, revision=args.revision)
    require_consistent(ck)  # inspect's checks, before hours of streaming
    rows = calibration_rows(ck, args.text, args.tokens, args.rows, args.cols)
    work = args.work or Path(f"{Path(args.src.rstrip('/')).name}.work")
    result = calibrate(ck, rows, work, settings, resume_every=args.resume_every)
    print(report(result))
    return 0


def report(result: CalibrationResult) -> str:
    """What was calibrated, per layer: routing spread, cold experts, site gains and measured unit KLs."""
    summary = result.summary
    measured = summary.gains == MEASURED_KL
    rows = []
    for layer in summary.layers:
        counts = layer.expert_tokens
        total = sum(counts)
        n_eff = total * total / max(sum(c * c for c in counts), 1e-30)
        row = [layer.layer, f"{n_eff:.1f}/{len(counts)}", sum(c == 0 for c in counts),
               len(layer.alias_candidates), f"{layer.attn_gain:.3g}", f"{layer.ffn_gain:.3g}"]
        if measured:
            row += [f"{layer.unit_kl[u]:.3g}" if u in layer.unit_kl else "-" for u in KL_UNITS]
        rows.append(row)
    headers = ["layer", "effective experts", "never routed", "cold", "attn gain", "ffn gain"]
    head = table(headers + ([f"KL {u}" for u in KL_UNITS] if measured else []), rows)
    resumed = f", {result.resumed_layers} layers from an earlier run" if result.resumed_layers else ""
    kind = (f"site sensitivity: {summary.gains}" + (f" (unit KL at K 3 noise on {summary.kl_rows} x "
                                                     f"{summary.kl_cols} tokens)" if measured else ""))
    return (f"{head}\ncalibrated {len(summary.tensors):,} tensors on {summary.rows} rows x {summary.cols} tokens "
            f"in {result.seconds:.1f} s{resumed}; {kind}\n{result.directory} ({result.fingerprint})")
