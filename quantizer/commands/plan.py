"""`quantizer plan SRC|--model-config C (--bpw B | --sparks N [--context C] [--streams S])
[--calibration WORK_OR_SUMMARY | --synthetic] [--loader PROFILE]
[--method ours|uniform|exl3] [--overlay [GROUPS]] [--cold-share S] [--alias/--no-alias] [--out plan.json]
[--recipe-out recipe.yaml]`

Methods: `ours` (allocate.py: least estimated error under the budget, from a calibration summary
or a synthetic one), `uniform` (uniform.py), `exl3` (exllamav3's own create_q_strategy,
exl3_baseline.py). The budget is --bpw, or with --sparks alone the most bits whose plan fits
that topology at --context x --streams; a V4.1 plan for one Spark defaults to native ExLlamaV3's V4.1
loader (exllamav3-v41), and a Spark count the profile's engine does not run is refused. Exit 0, or 1
when a --bpw plan does not fit the --sparks asked for (as `quantizer fit`), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS
from quantizer.calibrate.storage import CALIBRATION_DIR, SUMMARY_FILE, read_summary
from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.commands.arguments import (
    add_loader_argument,
    add_margin_argument,
    add_model_arguments,
    add_one_spark_arguments,
    add_plan_arguments,
    allocation_of,
    chosen_profile,
    fit_target,
    count,
    load_model_config,
    overlay_of,
    tokens,
    out_file,
)
from quantizer.contract.loader_profiles import default_profile
from quantizer.contract.plan import Plan
from quantizer.contract.rules import TOTAL_RESIDENT, check_plan
from quantizer.errors import UserError
from quantizer.exl3 import check_bpw, rate_grid
from quantizer.fit.cold_experts import check_share, routed_tokens
from quantizer.fit.hardware import load_hardware
from quantizer.fit.memory import MARGIN_GIB, TOPOLOGIES
from quantizer.fit.render import render as render_fit
from quantizer.fit.target import FittedPlan, choose_plan
from quantizer.fit.memory import FitTarget
from quantizer.orchestrate.price import build_price
from quantizer.plan.allocate import ALIAS_BELOW, DEFAULT_FLOOR
from quantizer.plan.exl3_baseline import HQ
from quantizer.plan.methods import EXL3, METHODS, OURS, UNIFORM, planner
from quantizer.plan.recipe import write_recipe
from quantizer.plan.sensitivity import synthetic_summary
from quantizer.plan.summary import plan_summary
from quantizer.plots import plot_path, save_figure
from quantizer.quantize.encode_hours import RateTable, plan_estimate
from quantizer.quantize.settings import ENCODERS
from quantizer.report import gib
from quantizer.tune.settings import TuneSettings
from quantizer.tune.stage import tune_line


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose K for every EXL3 tensor: at a bpw, or the most that fits N Sparks")
    add_model_arguments(p)
    p.add_argument("--bpw", type=float, help="target bits over the budgeted tensors: bits per routed weight where the loader "
                   "profile budgets the routed experts alone (vllm-exl3, exllamav3-v41), else over every tensor it "
                   "budgets; README.md, Words")
    p.add_argument("--sparks", type=int, choices=TOPOLOGIES,
                   help="DGX Sparks to fit; without --bpw, plan the most bits that fit them")
    p.add_argument("--context", type=tokens, help="tokens per stream for the fit (default: the model's max positions)")
    p.add_argument("--streams", type=count, default=1, help="concurrent streams, each holding --context tokens")
    add_margin_argument(p, "with --sparks alone the plan keeps it; a fit that leaves less says so")
    p.add_argument("--hardware", help="a hardware profile JSON for the fit (default: the shipped GB10 profile)")
    calib = p.add_mutually_exclusive_group()
    calib.add_argument("--calibration", help=f"a calibrate work directory (its {CALIBRATION_DIR}/{SUMMARY_FILE}), "
                                             "or a summary file")
    calib.add_argument("--synthetic", action="store_true",
                       help="plan from a synthetic calibration summary (no calibration run; plausible, not measured)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --synthetic summary")
    p.add_argument("--method", choices=METHODS,
                   help="allocator (default: ours with --calibration/--synthetic, else uniform)")
    add_loader_argument(p, "the engine the plan must load in, and the one its fit charges")
    p.add_argument("--alias", action=argparse.BooleanOptionalAction, default=None,
                   help="alias cold experts to warm ones: refused, no engine profile reads an alias map "
                        "(docs/loader-profiles.md)")
    p.add_argument("--alias-below", type=float, default=ALIAS_BELOW,
                   help="alias candidates: routed share below this fraction of the layer's mean")
    p.add_argument("--alias-cap", type=int, help="at most this many aliased experts per layer (default: 1/16 of them)")
    p.add_argument("--floor", type=float,
                   help=f"lowest K of attention, indexer, shared experts, Engram wkv (ours: {DEFAULT_FLOOR:g}; "
                        "uniform: its own rule)")
    p.add_argument("--hq", type=int, default=HQ, help="exllamav3's -hq for --method exl3")
    add_plan_arguments(p)
    add_one_spark_arguments(p)
    p.add_argument("--out", type=out_file, help="write the plan as JSON")
    p.add_argument("--json", action="store_true",
                   help="print what the plan costs as JSON instead of the text: bits, bytes, GPU-hours, and with --sparks "
                        "the fit and the decode model (tokens/s, GiB and kernel launches a token)")
    p.add_argument("--recipe-out", type=out_file, help="write the plan as an exllamav3 recipe.yaml")
    p.add_argument("--plot", help="also draw K per layer and projection as a heatmap to FILE.png (the plots extra)")
    p.add_argument("--plot-against", metavar="PLAN.json", action="append", default=[],
                   help="a plan of the same model drawn under this one, on one colour scale (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plot_against and not args.plot:
        raise UserError("--plot-against draws into --plot FILE.png: give --plot too")
    plot = plot_path(args.plot) if args.plot else None
    cfg = load_model_config(args.src, args.model_config)
    profile = chosen_profile(args) or default_profile(cfg, args.sparks)
    if args.sparks:
        profile.check_sparks(args.sparks)
    check_share(args.cold_share)
    against = [Plan.load(p) for p in args.plot_against]
    for other in against:
        check_plan(cfg, other)
    method = args.method or (OURS if args.calibration or args.synthetic else UNIFORM)
    if args.bpw is None and args.sparks is None:
        raise UserError("give --bpw B, or --sparks N to plan the most that fits N Sparks")
    if args.bpw is not None:
        check_bpw(args.bpw, args.codebook)
    summary = load_summary(cfg, args) if method == OURS else None
    if args.cold_share and summary is None:
        raise UserError("--cold-share picks cold experts by the calibration's routing: give --calibration WORK "
                        "(or --synthetic)")
    settings = allocation_of(args, profile, args.codebook, overlay_of(args, profile, args.codebook))
    plan_at, lowest = planner(cfg, method, settings, summary, args.floor, args.hq)
    print(allocator_line(args, method, summary), file=sys.stderr)
    target = fit_target(args, cfg, profile)
    plan, fitted = choose_plan(cfg, plan_at, lowest, rate_grid(args.codebook)[-1], target, args.bpw,
                               hardware=load_hardware(args.hardware), tokens=routed_tokens(summary) if summary else None)
    _print(cfg, plan, fitted, args.json)
    _write(cfg, args, plan, method, target, against, plot)
    return 1 if fitted and not fitted.report.fits else 0


def _print(cfg: ModelConfig, plan: Plan, fitted: FittedPlan | None, as_json: bool) -> None:
    """The plan's bits and bytes, its GPU-hours, and with a target its fit and launch settings (or the JSON of them)."""
    hours = [plan_estimate(cfg, plan, RateTable.load(encoder=encoder)) for encoder in ENCODERS["cuda"]]
    if as_json:
        print(json.dumps(plan_json(plan, hours, fitted) | {"price": build_price(cfg, plan).to_dict()}, indent=1))
        return
    print(plan_summary(cfg, plan))
    for estimate in hours:  # the default's hours, then the other's (its line names it)
        print(estimate.line())
    print(tune_line(cfg, DEFAULT_ROWS, DEFAULT_COLS, TuneSettings()))
    print("\n".join(build_price(cfg, plan).lines()))
    if fitted:
        print("\n" + render_fit(fitted.report))
    if fitted and fitted.launch.cold_experts:
        print(f"cold experts: {len(fitted.launch.cold_experts)} served from the mapped file "
              f"({fitted.launch.cold_share:.2%} of the calibration's routed tokens); `build` writes them into the "
              "pack's launch.env")


def _write(cfg: ModelConfig, args: argparse.Namespace, plan: Plan, method: str, target: FitTarget | None,
           against: list[Plan], plot) -> None:
    """--out, --recipe-out and --plot, each with a line saying so (on stderr with --json)."""
    note = sys.stderr if args.json else sys.stdout  # --json keeps stdout to the one JSON object
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}", file=note)
    if args.recipe_out:
        write_recipe(cfg, plan, args.recipe_out, recipe_header(args, plan, method, target))
        print(f"wrote {args.recipe_out}", file=note)
    if plot:
        from quantizer.plots.plan import k_figure

        save_figure(k_figure(cfg, [plan] + against), plot)
        print(f"wrote {plot}", file=note)


def plan_json(plan: Plan, hours: list, fitted) -> dict:
    """`plan --json`: the plan's bits and bytes, the GPU-hours per encoder, and with a fit target the fit report
    (its `decode`: the decode model's rate, bytes and launches a token) and the launch settings."""
    out = {"made_by": plan.made_by, "loader": plan.profile.name, "codebook": plan.codebook,
           "target_bpw": plan.target_bpw, "achieved_bpw": plan.achieved_bpw, "head_bits": plan.head_bits,
           "expected_bytes": plan.expected_bytes, "plan_hash": plan.content_hash(),
           "gpu_hours": {h.encoder: round(h.gpu_hours, 3) for h in hours}, "fit": None, "launch": None}
    if fitted:
        out["fit"] = fitted.report.to_dict()
        out["launch"] = asdict(fitted.launch) | {"copy_pattern": fitted.launch.copy_pattern}
    return out


def allocator_line(args: argparse.Namespace, method: str, summary: CalibrationSummary | None) -> str:
    """Which allocator chose K, and on which calibration, said before the plan: without --calibration or
    --synthetic the default is uniform, a plan no sensitivity shaped, which a reader of the plan alone could miss."""
    if method == OURS and args.synthetic:
        return (f"allocator: ours, on a synthetic calibration summary (--synthetic, seed {args.seed}): plausible "
                "sensitivities, not measured ones; --calibration WORK plans on a real calibration")
    if method == OURS:
        made = ("made up, not measured" if summary.synthetic else
                f"{summary.rows} rows x {summary.cols} tokens, {summary.gains} site gains")
        return f"allocator: ours, on the calibration summary {args.calibration} ({made})"
    given = "--calibration" if args.calibration else "--synthetic" if args.synthetic else None
    unused = f"; {given} is not used" if given else ""
    if method == EXL3:
        return f"allocator: exl3, exllamav3's own create_q_strategy (-hq {args.hq}), which reads no calibration{unused}"
    if args.method is None:
        return ("allocator: uniform K (no --calibration or --synthetic given, so no sensitivities to allocate by; "
                "add --synthetic for ours on a synthetic calibration, or --calibration WORK for ours on a real one)")
    return f"allocator: uniform K (--method uniform){unused}"


def load_summary(cfg: ModelConfig, args: argparse.Namespace) -> CalibrationSummary:
    """The calibration summary for --method ours: --calibration (a work dir or file) or --synthetic."""
    if args.synthetic:
        return synthetic_summary(cfg, args.seed)
    if not args.calibration:
        raise UserError("--method ours needs a calibration summary: --calibration WORK_DIR|SUMMARY.json, "
                        "or --synthetic to plan from a made-up one")
    return read_summary(args.calibration)


def recipe_header(args: argparse.Namespace, plan: Plan, method: str = UNIFORM, target: FitTarget | None = None) -> str:
    model = args.model_config or "<checkpoint>/config.json"
    extra = f" --loader {plan.profile.name}" + ("" if args.codebook == "mul1" else f" --codebook {args.codebook}")
    if args.overlay is not None:
        extra += f" --overlay {args.overlay}".rstrip() + f" --overlay-bits {args.overlay_bits:g}"
    budget = f"--bpw {args.bpw:g}" if args.bpw is not None else _fit_flags(target)
    if method != UNIFORM:
        extra += _method_flags(args, method)
    lines = [
        f"exllamav3 recipe for {model} at {plan.target_bpw:g} bpw, for the {plan.profile.name} loader profile.",
        f"Plan: {plan.made_by}.",
        f"Regenerate: quantizer plan --model-config {model} {budget}{extra} --recipe-out <this file>",
        f"Achieved bits (exllamav3 accounting, budgeted tensors): {plan.achieved_bpw:.4f}; "
        f"expected pack {gib(plan.expected_bytes[TOTAL_RESIDENT])} GiB without the Engram tables.",
        "Values: 1..8, 1.5/2.5/3.5 (mul1), 16 = fp16; `native` (ours) keeps the source storage.",
    ]
    if all(k is None for key, k in plan.k.items() if key.startswith("mtp.")):
        lines.append("The DSpark drafter (mtp.*) is not listed, so it stays native.")
    if target:
        lines.insert(1, f"Budget: the most bits that fit {target.describe()}.")
    if plan.aliases:
        lines.append(f"Aliases: {len(plan.aliases)} cold experts are served by a warm expert of their layer; the "
                     "pack stores only the warm one (the alias map is in the plan and the pack manifest):")
        lines += [f"  {cold} -> {warm}" for cold, warm in plan.aliases.items()]
    return "\n".join(lines)


def _fit_flags(target: FitTarget) -> str:
    flags = f"--sparks {target.sparks} --context {target.context}"
    flags += f" --streams {target.streams}" if target.streams != 1 else ""
    flags += f" --cold-share {target.cold_share:g}" if target.cold_share else ""
    return flags + (f" --margin {target.margin_gib:g}" if target.margin_gib != MARGIN_GIB else "")


def _method_flags(args: argparse.Namespace, method: str) -> str:
    if method == EXL3:
        return f" --method exl3 --hq {args.hq}"
    flags = f" --synthetic --seed {args.seed}" if args.synthetic else f" --calibration {args.calibration}"
    flags += "" if args.alias is None else (" --alias" if args.alias else " --no-alias")
    flags += "" if args.floor is None else f" --floor {args.floor:g}"
    return flags
