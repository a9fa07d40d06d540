"""`quantizer fit PACK | --model-config C (--recipe R.yaml | --bpw B | --plan P.json) [--loader L [--overlay]]`
on 1, 2 or 4 Sparks.

The fit charges the engine of one loader profile: a pack's, a plan's, the one a recipe names, else
--loader, else the one `plan` would choose for the model and Spark count (default_loader); a --bpw plan
is the one that profile's `plan` builds, so fit and plan give one answer. Prints a per-rank table and a
verdict; exit 0 when it fits, 1 when it does not, 2 on bad input. On an engine
that serves weights from the mapped file (native ExLlamaV3's V4.1 loader) a pack's launch.env says what
is copied and whether the drafter runs; a plan's drafter runs where it is EXL3 (fit/target.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

from quantizer.commands.arguments import (
    add_loader_argument,
    add_margin_argument,
    add_model_arguments,
    add_one_spark_arguments,
    add_plan_arguments,
    chosen_loader,
    count,
    load_model_config,
    overlay_of,
    tokens,
)
from quantizer.contract.loader_profiles import check_loader, default_loader, load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import check_plan
from quantizer.errors import UserError
from quantizer.exl3 import check_bpw
from quantizer.fit.hardware import DESIGN_FLOOR, load_hardware
from quantizer.fit.launch import read_launch
from quantizer.fit.memory import BPW_FLOOR, TOPOLOGIES, FitOptions, FitTarget, fit
from quantizer.fit.placement import DRAFTER_MODES, ENGRAM_MODES, SPLITS, VISION_MODES
from quantizer.fit.render import render
from quantizer.fit.stored import stored_from_pack
from quantizer.fit.target import runs_drafter
from quantizer.pack.manifest import Manifest, is_pack
from quantizer.plan.recipe import default_note, plan_from_recipe, read_recipe, recipe_loader
from quantizer.plan.uniform import lowest_uniform_bpw, uniform_plan
from quantizer.plots import plot_path, save_figure


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="per-rank memory of a pack (or recipe / bpw) on 1, 2 or 4 DGX Sparks")
    add_model_arguments(p, "pack directory (headers are read), or a checkpoint whose config.json "
                           "gives the shape for --recipe/--bpw/--plan")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--recipe", help="an exllamav3 recipe.yaml (with --model-config)")
    src.add_argument("--bpw", type=float, help="a uniform plan at this bpw (with --model-config)")
    src.add_argument("--plan", help="a plan.json written by `quantizer plan` (with --model-config)")
    add_plan_arguments(p)
    add_loader_argument(p, "the engine the fit charges, and with --bpw the layout of its plan (default: a pack's, "
                           "a plan's or a recipe's own, else the one `plan` chooses for the model and --sparks)")
    add_one_spark_arguments(p)
    p.add_argument("--sparks", type=int, choices=TOPOLOGIES, default=2, help="DGX Sparks (tensor-parallel ranks)")
    p.add_argument("--context", type=tokens, help="tokens per stream (default: the model's max positions)")
    p.add_argument("--streams", type=count, default=1, help="concurrent streams, each holding --context tokens")
    p.add_argument("--split", choices=SPLITS, default="tp",
                   help="routed experts: tensor-parallel slices (tp) or whole experts per rank (ep)")
    p.add_argument("--engram", choices=ENGRAM_MODES, default="nvme")
    p.add_argument("--drafter", choices=DRAFTER_MODES,
                   help="DSpark drafter placement (default split; off where a one-Spark pack or plan keeps it in source "
                        "form, as its launch.env says)")
    p.add_argument("--fp8-lazy", action="store_true",
                   help="native ExLlamaV3's V4.1 loader with EXL3_FP8_LAZY=1: source-form FP8/FP4 linears stay compact "
                        "instead of being dequantized to FP16 at load (the recipe launches without it)")
    p.add_argument("--vision", choices=VISION_MODES, default="rank0")
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
    asked = chosen_loader(args)
    stored_at_bpw, lowest_bpw = None, BPW_FLOOR
    drafter, copy = args.drafter, None
    if args.overlay is not None and args.bpw is None:
        raise UserError("--overlay makes a plan for --bpw; a pack, plan or recipe holds its K already")
    if args.src and not (args.recipe or args.bpw is not None or args.plan):
        cfg, stored = stored_from_pack(args.src)
        source = str(args.src)
        loader = check_loader(asked, Manifest.load(Path(args.src)).plan["loader"], args.src) if is_pack(args.src) \
            else asked or default_loader(cfg, args.sparks)
        load_profile(loader).check_sparks(args.sparks)
        launch = read_launch(args.src)
        if launch:
            copy, drafter = launch[0], drafter or ("split" if launch[1] else "off")
    else:
        cfg = load_model_config(args.src, args.model_config)
        if args.plan:
            plan, source = Plan.load(args.plan), args.plan
            check_loader(asked, plan.profile.name, args.plan)
            check_plan(cfg, plan)
        elif args.recipe:
            recipe = read_recipe(args.recipe)
            loader = recipe_loader(cfg, recipe, args.sparks, asked)
            plan = plan_from_recipe(cfg, recipe, args.codebook, loader)
            source = args.recipe + default_note(cfg, recipe, loader, args.sparks)
        elif args.bpw is not None:
            loader = asked or default_loader(cfg, args.sparks)
            check_bpw(args.bpw, args.codebook)
            make = functools.partial(_uniform, cfg, args, loader, overlay_of(args, load_profile(loader), args.codebook))
            plan, source = make(args.bpw), f"uniform plan at {args.bpw:g} bpw"
            stored_at_bpw = functools.lru_cache(maxsize=1)(lambda b: pack_spec(cfg, make(b)).tensors)
            lowest_bpw = lowest_uniform_bpw(cfg, args.codebook, loader=loader)
        else:
            raise UserError("with --model-config give --recipe R.yaml, --bpw B or --plan P.json")
        loader = plan.profile.name
        plan.profile.check_sparks(args.sparks)
        if drafter is None and not runs_drafter(cfg, plan, plan.profile.fit_engine, hw):
            drafter = "off"
        stored = pack_spec(cfg, plan).tensors
    engine = load_profile(loader).fit_engine
    target = FitTarget(args.sparks, cfg.max_position_embeddings if args.context is None else args.context,
                       args.streams, engine, margin_gib=args.margin)
    options = FitOptions(args.split, args.engram, drafter or "split", args.vision, args.guard, args.kv_bits, copy,
                         args.fp8_lazy)
    report = fit(cfg, stored, target, options, hardware=hw, source=source, stored_at_bpw=stored_at_bpw, bpw=args.bpw,
                 lowest_bpw=lowest_bpw)
    floor = fit(cfg, stored, dataclasses.replace(target, engine=DESIGN_FLOOR), options, hardware=hw, source=source) \
        if args.explain and not args.json else None
    print(report.to_json() if args.json else render(report, args.explain, floor))
    if plot:
        from quantizer.plots.fit import fit_figure

        save_figure(fit_figure([[report]]), plot)
    return 0 if report.fits else 1


def _uniform(cfg, args, loader: str, overlay, bpw: float):
    return uniform_plan(cfg, bpw, args.codebook, args.head_bits, args.drafter_bits, loader=loader, overlay=overlay)
