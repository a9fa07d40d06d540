"""`quantizer fit PACK | --model-config C (--recipe R.yaml | --bpw B | --plan P.json) [--loader L [--overlay]]`
on 1, 2 or 4 Sparks.

Fit is a memory model first: it sizes any pack, plan or recipe, in the memory model of one loader profile's
engine: --loader's, else the one the pack, plan or recipe names, else the one whose rules the layout meets
(the closest where none does; a --bpw plan is the one that profile's `plan` builds, so fit and plan give one
answer). The rules a layout breaks are one finding line with their count; they do not change the exit code.
Prints a per-rank table and a verdict; exit 0 when it fits, 1 when it does not, 2 on bad input. On an engine
that serves weights from the mapped file (native ExLlamaV3's V4.1 loader) a pack's launch.env says what
is copied, whether the drafter runs and the context the pack was planned for (CTX: the default --context, the
model's full context fitted beside it; a pack without it is fitted at the full context and says so); a plan's
drafter runs where it is EXL3 (fit/target.py). On that
engine a plan, recipe or --bpw may leave experts cold (--cold-share with --calibration, as `plan` and `build`
place them: fit/cold_experts.py); a flag that would change nothing (a pack, whose launch.env fixes its cold
experts, or an engine that copies every weight) is refused rather than ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from quantizer.commands.arguments import (
    add_loader_argument,
    add_margin_argument,
    add_model_arguments,
    add_one_spark_arguments,
    add_plan_arguments,
    chosen_profile,
    count,
    load_model_config,
    overlay_of,
    tokens,
)
from quantizer.calibrate.storage import read_summary
from quantizer.contract.pack_spec import pack_spec
from quantizer.errors import UserError
from quantizer.fit.cold_experts import check_share, place_cold_experts, routed_tokens
from quantizer.fit.decode import decode_cost
from quantizer.fit.hardware import DESIGN_FLOOR, load_hardware
from quantizer.fit.memory import TOPOLOGIES, FitOptions, FitReport, FitTarget, Scenario, fit
from quantizer.fit.placement import DRAFTER_MODES, ENGRAM_MODES, SPLITS, VISION_MODES
from quantizer.fit.render import context_note, render
from quantizer.fit.target import routing_of, runs_drafter
from quantizer.pack.fit_input import FitInput, open_fit_input
from quantizer.plan.uniform import lowest_uniform_bpw, uniform_plan
from quantizer.plots import plot_path, save_figure

DEFAULT_SPARKS = 2  # what a native checkpoint, plan or recipe is fitted to without --sparks


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="per-rank memory of a pack (or recipe / bpw) on 1, 2 or 4 DGX Sparks")
    add_model_arguments(p, "pack directory (headers are read), or a checkpoint whose config.json "
                           "gives the shape for --recipe/--bpw/--plan")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--recipe", help="an exllamav3 recipe.yaml (with --model-config)")
    src.add_argument("--bpw", type=float, help="a uniform plan at this bpw (with --model-config)")
    src.add_argument("--plan", help="a plan.json written by `quantizer plan` (with --model-config)")
    add_plan_arguments(p)
    add_loader_argument(p, "the engine whose memory model the fit charges (a layout that breaks its rules is sized all "
                           "the same, with one finding line), and with --bpw the layout of its plan (default: a pack's, "
                           "a plan's or a recipe's own, else the profile whose rules the layout meets on --sparks)")
    add_one_spark_arguments(p)
    p.add_argument("--calibration", help="with --cold-share: the calibrate work directory (or summary file) whose "
                                         "routing picks the cold experts")
    p.add_argument("--sparks", type=int, choices=TOPOLOGIES,
                   help=f"DGX Sparks (tensor-parallel ranks; default: the count a pack was built for, else the profile's "
                        f"only one, else {DEFAULT_SPARKS})")
    p.add_argument("--context", type=tokens,
                   help="tokens per stream (default: the context a pack was planned for, its launch.env's CTX, with "
                        "the verdict at the model's full context beside it; else the model's max positions)")
    p.add_argument("--streams", type=count,
                   help="concurrent streams, each holding --context tokens (default: a pack's planned streams, else 1)")
    p.add_argument("--split", choices=SPLITS, default="tp",
                   help="routed experts: tensor-parallel slices (tp) or whole experts per rank (ep)")
    p.add_argument("--engram", choices=ENGRAM_MODES, default="nvme")
    p.add_argument("--drafter", choices=DRAFTER_MODES,
                   help="DSpark drafter placement (default split; off where a one-Spark pack or plan keeps it in source "
                        "form, as its launch.env says)")
    p.add_argument("--fp8-lazy", action="store_true",
                   help="native ExLlamaV3's V4.1 loader with EXL3_FP8_LAZY=1: source-form FP8/FP4 linears stay compact "
                        "instead of being dequantized to FP16 at load (the recipe launches without it)")
    p.add_argument("--vision", choices=VISION_MODES,
                   help="where the vision encoder runs (default: where the engine runs it; vLLM on every rank, "
                        "TensorFold on rank 0)")
    p.add_argument("--guard", type=float, help="guard floor in GiB (default from the hardware file)")
    p.add_argument("--kv-bits", type=float, help="K of exllamav3's packed DSA pool (fp16 pools otherwise)")
    add_margin_argument(p, "a fit that leaves less says so next to its verdict")
    p.add_argument("--hardware", help="a hardware profile JSON (default: the shipped GB10 profile)")
    p.add_argument("--explain", action="store_true",
                   help="show every term with its source, and the design floor (a lower bound no engine reaches)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", help="also draw the memory per rank as stacked bars to FILE.png (the plots extra)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plot = plot_path(args.plot) if args.plot else None
    hw = load_hardware(args.hardware)
    what = _open(args)
    args.sparks, args.streams = _planned_defaults(args, what)
    what.profile.check_sparks(args.sparks)
    launch = what.launch
    drafter = args.drafter or ("off" if (launch and not launch.drafter) or (
        what.plan and not runs_drafter(what.cfg, what.plan, what.profile.fit_engine, hw)) else "split")
    cfg = what.cfg
    context, note = _context(args, what)
    target = FitTarget(args.sparks, context, args.streams, what.profile.fit_engine, margin_gib=args.margin)
    options = FitOptions(args.split, args.engram, drafter, args.vision, args.guard, args.kv_bits,
                         launch and launch.copy_pattern, args.fp8_lazy, launch and launch.mmap_min)
    tokens = _cold_share_routing(args, what, hw)
    cold = None
    if tokens:
        scenario = Scenario(sparks=target.sparks, context=target.context, streams=target.streams, engine=target.engine,
                            **dataclasses.asdict(options))
        placed, cold = place_cold_experts(cfg, what.stored, scenario, hw, tokens, args.cold_share, margin_gib=args.margin)
        options = dataclasses.replace(options, copy_pattern=placed.copy_pattern)
    search = _bpw_search(cfg, args, what.profile) if args.bpw is not None else {}
    report = fit(cfg, what.stored, target, options, hardware=hw, source=what.source, findings=what.findings,
                 loader=what.profile.name, **search)
    report.decode = decode_cost(cfg, what.plan, what.stored, what.profile, args.sparks, hw, report.context,
                                report.drafter != "off", routing_of(tokens))
    floor, full = _beside(args, what, target, options, hw, bool(note) and context < cfg.max_position_embeddings)
    print(report.to_json() if args.json else render(report, args.explain, floor, note, full))
    if cold is not None:
        print(f"cold experts: {len(cold.cold_experts)} served from the mapped file ({cold.cold_share:.2%} of the "
              f"calibration's routed tokens, --cold-share {args.cold_share:g})", file=sys.stderr if args.json else sys.stdout)
    if plot:
        from quantizer.plots.fit import fit_figure

        save_figure(fit_figure([[report]]), plot)
    return 0 if report.fits else 1


def _planned_defaults(args: argparse.Namespace, what: FitInput) -> tuple[int, int]:
    """--sparks and --streams as given; else what a pack was fitted to at build time; else the profile's one Spark
    count (2 where it runs on several) and one stream."""
    planned = what.planned
    sparks = args.sparks or (planned and planned.sparks) or (what.profile.sparks[0] if len(what.profile.sparks) == 1
                                                             else DEFAULT_SPARKS)
    return sparks, args.streams or (planned and planned.streams) or 1


def _context(args: argparse.Namespace, what: FitInput) -> tuple[int, str | None]:
    """--context, which wins; else the context a pack was planned for (recorded at build time, or its launch.env's
    CTX); else the model's full context. For a pack fitted by default, with the line that says which."""
    full, planned = what.cfg.max_position_embeddings, what.planned and what.planned.context
    if args.context:
        return args.context, None
    return planned or full, context_note(planned, full) if what.packed else None


def _beside(args: argparse.Namespace, what: FitInput, target: FitTarget, options: FitOptions, hw,
            full_context: bool) -> tuple[FitReport | None, FitReport | None]:
    """What the table prints beside the fit: DeepSeek's design floor (--explain), and the same fit at the model's
    full context where `full_context` (a pack planned for less)."""
    if args.json:
        return None, None
    at = functools.partial(fit, what.cfg, what.stored, options=options, hardware=hw, source=what.source)
    return (at(dataclasses.replace(target, engine=DESIGN_FLOOR)) if args.explain else None,
            at(dataclasses.replace(target, context=what.cfg.max_position_embeddings)) if full_context else None)


def _open(args: argparse.Namespace) -> FitInput:
    """The pack, plan, recipe or --bpw plan the flags name, with the profile that charges it."""
    if args.overlay is not None and args.bpw is None:
        raise UserError("--overlay makes a plan for --bpw; a pack, plan or recipe holds its K already")
    pack_only = args.src and not (args.recipe or args.bpw is not None or args.plan)
    cfg = None if pack_only else load_model_config(args.src, args.model_config)
    return open_fit_input(args.src, cfg, chosen_profile(args), args.sparks or DEFAULT_SPARKS, args.plan, args.recipe, args.bpw,
                          args.codebook, lambda profile: _uniform_at(cfg, args, profile))


def _cold_share_routing(args: argparse.Namespace, what: FitInput, hw) -> dict[str, float] | None:
    """The calibration's routed tokens per expert for --cold-share, where it can move experts out of GPU memory:
    a plan, recipe or --bpw on an engine that serves weights from the mapped file. None without --cold-share;
    UserError where the flag would change nothing."""
    if args.calibration and not args.cold_share:
        raise UserError("--calibration gives --cold-share the routing that picks cold experts; add --cold-share S")
    if not check_share(args.cold_share):
        return None
    if hw.engine(what.profile.fit_engine).mapped is None:
        raise UserError(f"--cold-share: the {what.profile.name} engine copies every weight into GPU memory, so no expert "
                        "can stay cold; cold experts are the one-Spark engine's (--loader exllamav3-v41)")
    if what.launch is not None or not (args.plan or args.recipe or args.bpw is not None):
        fixed = "its launch.env fixes its cold experts" if what.launch else "it is sized as it is stored"
        raise UserError(f"--cold-share chooses the cold experts of a plan (--plan, --recipe or --bpw); {args.src}: {fixed}")
    if not args.calibration:
        raise UserError("--cold-share picks cold experts by the calibration's routing: give --calibration WORK")
    return routed_tokens(read_summary(args.calibration))


def _uniform_at(cfg, args, profile):
    """bpw -> the uniform plan `plan --bpw` makes for the profile and the flags."""
    overlay = overlay_of(args, profile, args.codebook)
    return lambda bpw: uniform_plan(cfg, bpw, args.codebook, args.head_bits, args.drafter_bits, profile=profile,
                                    overlay=overlay, expert_layout=args.expert_layout, half_rates=args.half_rates)


def _bpw_search(cfg, args, profile) -> dict:
    """What fit needs to say which bpw would fit: the pack at any bpw, from the lowest a uniform plan takes."""
    plan_at = _uniform_at(cfg, args, profile)
    stored_at = functools.lru_cache(maxsize=1)(lambda b: pack_spec(cfg, plan_at(b)).tensors)
    return {"stored_at_bpw": stored_at, "bpw": args.bpw,
            "lowest_bpw": lowest_uniform_bpw(cfg, args.codebook, profile=profile, half_rates=args.half_rates)}
