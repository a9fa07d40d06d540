"""`quantizer build SRC (--bpw B | --plan PLAN.json | --recipe R.yaml | --sparks N) [--sparks N [--context C] [--cold-share S]]
--out PACK
[--method ours|uniform|exl3] [--loader PROFILE] [--head-bits K]
[--drafter-bits K] [--overlay [GROUPS]]
[--text FILE | --tokens FILE | --no-calibrate] ...`

Calibrates (the shipped calibration set by default), plans, quantizes, packs and verifies. Rerun the
same command after an interruption and it continues where it stopped; a rerun with a different
source, plan or settings is refused with the difference named. A plan or recipe decides the loader
profile (a --loader that contradicts it is refused); otherwise --loader, else the default for the model
and Spark count. --sparks alone plans the most bits that fit; beside --bpw, --plan or --recipe it is what
the pack is fitted to (its verdict, and on one Spark its cold experts and launch.env context).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from quantizer.orchestrate.stages import BuildRequest, build
from quantizer.orchestrate.summary import build_summary
from quantizer.calibrate.rows import calibration_rows
from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS, CalibrationSettings
from quantizer.checkpoint.source import Checkpoint
from quantizer.commands.arguments import (
    add_device_argument,
    add_expert_hessians,
    add_head_drafter_arguments,
    add_layout_arguments,
    add_loader_argument,
    add_margin_argument,
    add_one_spark_arguments,
    allocation_of,
    chosen_profile,
    fit_target,
    count,
    overlay_of,
    repo_id,
    revision,
    tokens,
    out_dir,
)
from quantizer.contract.loader_profiles import LoaderProfile, check_loader, default_profile
from quantizer.contract.plan import Plan
from quantizer.distributed import current
from quantizer.errors import UserError
from quantizer.exl3 import CODEBOOKS
from quantizer.fit.hardware import load_hardware
from quantizer.fit.memory import TOPOLOGIES
from quantizer.pack.writer import DEFAULT_SHARD_SIZE
from quantizer.plan.allocate import AllocationSettings
from quantizer.plan.methods import METHODS, OURS
from quantizer.plan.recipe import plan_from_recipe, profile_note, read_recipe
from quantizer.quantize.settings import ENCODERS, QuantizeSettings
from quantizer.tune.settings import INPUTS, TARGETS, EndToEndSettings, TuneSettings

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="plan, quantize, pack and verify in one resumable work directory")
    p.add_argument("src", help="native checkpoint directory or Hugging Face repo id")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--bpw", type=float, help="bits over the budgeted tensors: bits per routed weight where the loader "
                   "profile budgets the routed experts alone (vllm-exl3, exllamav3-v41), else over every tensor it "
                   "budgets; README.md, Words")
    p.add_argument("--sparks", type=int, choices=TOPOLOGIES,
                   help="DGX Sparks: alone, the most bits whose pack fits them; with --bpw, --plan or --recipe, what "
                        "the pack is fitted to")
    rate.add_argument("--plan", type=Path, help="a plan file written by `quantizer plan`")
    rate.add_argument("--recipe", type=Path, help="an exllamav3 recipe.yaml (`quantizer plan --recipe-out`, or "
                                                  "hand-written); the loader profile it names decides the engine")
    p.add_argument("--context", type=tokens, help="with --sparks: tokens per stream (default: the model's max positions)")
    p.add_argument("--streams", type=count, default=1, help="with --sparks: concurrent streams (default 1)")
    add_margin_argument(p, "with --sparks, the pack keeps it")
    p.add_argument("--method", choices=METHODS, default=OURS,
                   help="ours: the allocator on the calibration (default); uniform; exl3: exllamav3's own allocator")
    add_loader_argument(p, "the engine the pack must load in; the pack is verified against it. A --plan or --recipe "
                           "decides it")
    add_head_drafter_arguments(p)
    add_layout_arguments(p)
    add_one_spark_arguments(p)
    data = p.add_mutually_exclusive_group()
    data.add_argument("--text", help="calibration text (.txt, .jsonl, optionally .zst) or a shipped set's name "
                      "(default: calibration)")
    data.add_argument("--tokens", help="calibration token ids (.npy, or .safetensors with input_ids)")
    data.add_argument("--no-calibrate", action="store_true",
                      help="no calibration: linears quantized without Hessians (uniform, exl3 or --plan only)")
    p.add_argument("--calib-rows", type=count,
                   help=f"calibration rows (default: up to {DEFAULT_ROWS}, as many as the text holds)")
    p.add_argument("--calib-cols", type=count,
                   help=f"tokens per calibration row (default: a 2-D token file's width, else {DEFAULT_COLS})")
    p.add_argument("--row-chunk", type=count,
                   help="calibration rows pushed through a block together (default: 16384 tokens' worth); "
                        "under torchrun the chunks are what the ranks share")
    add_expert_hessians(p)
    p.add_argument("--hardware", help="a hardware profile JSON for the fit (default: the shipped GB10 profile)")
    p.add_argument("--out", type=out_dir, required=True, help="pack directory to write (must not exist)")
    p.add_argument("--work", type=out_dir, help="work directory (default: <out>.work); rerun to resume, or share it "
                                              "between builds of one source and settings: encodings are reused")
    p.add_argument("--measured-errors", action="store_true",
                   help="ours: allocate on the proxy errors measured by the encodings already in --work (earlier "
                        "builds sharing it) instead of the model's estimate for those (tensor, K); costs a header read")
    add_device_argument(p, "where calibration, quantize and tuning run. cpu: our codec (--encoder fast or exact); "
                           "cuda: exllamav3's conversion steps, in our batch loop with our tile-search kernel "
                           "(--encoder ours) or exllamav3's own conversion (--encoder exllamav3); needs exllamav3: "
                           "pip install 'quantizer[gpu]'")
    p.add_argument("--encoder", choices=sorted({e for encoders in ENCODERS.values() for e in encoders}),
                   help="the quantize stage's encoder on --device. cpu: our codec's Viterbi first pass, fast (default) "
                        "or exact; cuda: exllamav3's conversion steps in our batch loop with our tile-search kernel "
                        "(ours, default: the same codes, the quantize stage 2.6-3.4x faster at K 2-4 and the half "
                        "rates on an H100, docs/encoder.md) or exllamav3's own conversion (exllamav3)")
    p.add_argument("--seed", type=int, default=0, help="job seed; each linear's seed derives from it and its key")
    p.add_argument("--tune", action="store_true",
                   help="after quantize, fit each block's EXL3 suh/svh to the native block's outputs on the calibration "
                        "rows (codes fixed; same pack bytes; runs on --device; off by default, docs/tuning.md)")
    p.add_argument("--tune-steps", type=count, help=f"with --tune: Adam steps per block at most (default {TuneSettings.steps})")
    p.add_argument("--tune-inputs", choices=INPUTS,
                   help=f"with --tune: block inputs from the native model or the tuned blocks before (default "
                        f"{TuneSettings.inputs})")
    p.add_argument("--tune-target", choices=TARGETS,
                   help="with --tune --tune-inputs quantized: fit each block to the native block on the same inputs "
                        "(block, default) or to the native model's stream after it (model)")
    p.add_argument("--tune-e2e", action="store_true",
                   help="after quantize (and --tune), fit every EXL3 suh/svh of the trunk and head to the native model's "
                        "next-token distributions (KL) on the calibration rows; holds the whole model: small models only, "
                        "refused up front where it does not fit (docs/tuning.md)")
    p.add_argument("--tune-e2e-steps", type=count,
                   help=f"with --tune-e2e: Adam steps at most (default {EndToEndSettings.steps})")
    p.add_argument("--shard-size", type=parse_size, default=DEFAULT_SHARD_SIZE, help="shard cap, e.g. 8G, 512M (default 8G)")
    p.add_argument("--codebook", choices=CODEBOOKS, help="EXL3 codebook of a uniform plan (default mul1)")
    p.add_argument("--revision", type=revision, help="revision of a Hugging Face repo id")
    p.add_argument("--base-model", type=repo_id, metavar="ORG/NAME",
                   help="the source's Hugging Face repo id, for the pack's card (default: SRC when it is a repo id)")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 8G, 512M or a byte count")
    return int(float(m[1]) * UNITS[m[2].upper()])


def run(args: argparse.Namespace) -> int:
    calibration_settings = CalibrationSettings(device=args.device, row_chunk=args.row_chunk,
                                               expert_hessians=args.expert_hessians)  # a bad name: one line, first
    asked, given = chosen_profile(args), args.plan or args.recipe
    plan = _plan_file(args)
    _check_flags(args)
    ck = Checkpoint.open(args.src, revision=args.revision)
    plan = plan or _recipe_plan(args, ck.config, asked)
    profile = check_loader(asked, plan.profile, str(given)) if plan else asked or default_profile(ck.config, args.sparks)
    codebook = args.codebook or "mul1"
    overlay = overlay_of(args, profile, codebook)
    sparks = args.sparks or (profile.sparks[0] if len(profile.sparks) == 1 else None)  # a one-Spark engine's count
    if sparks is None and (args.context is not None or args.streams != 1 or args.cold_share):
        raise UserError("--context, --streams and --cold-share size the fit of a Spark count: add --sparks N")
    asks_fit = args.sparks or args.context is not None or args.streams != 1 or args.cold_share
    rows = None if args.no_calibrate else calibration_rows(ck, args.text, args.tokens, args.calib_rows, args.calib_cols)
    req = BuildRequest(
        src=args.src, out=args.out, bpw=args.bpw, plan=plan,
        target=fit_target(args, ck.config, profile, sparks) if asks_fit else None, method=args.method,
        allocation=allocation_of(args, profile, codebook, overlay), calibration_rows=rows,
        calibration_settings=calibration_settings,
        work=args.work, revision=args.revision, shard_size=args.shard_size,
        quantize=QuantizeSettings(seed=args.seed, device=args.device, encoder=args.encoder),
        measured_from_work=args.measured_errors, plan_file=given,
        base_model=args.base_model or (None if Path(args.src).expanduser().exists() else args.src),
        command=rebuild_command(args.argv), tune=_tune(args),
        end_to_end=EndToEndSettings(steps=args.tune_e2e_steps or EndToEndSettings.steps) if args.tune_e2e else None,
        hardware=load_hardware(args.hardware) if args.hardware else None,
    )
    result = build(req)
    if current().main:
        print(build_summary(result))
    return 1 if result.fit and not result.fit.fits else 0


def _check_flags(args: argparse.Namespace) -> None:
    """The flag combinations refused before the source is opened: no budget, or plan flags beside a plan."""
    if (args.bpw, args.plan, args.recipe, args.sparks) == (None, None, None, None):
        raise UserError("give --bpw B, --plan PLAN.json, --recipe R.yaml or --sparks N")
    given = args.plan or args.recipe
    if given and args.overlay is not None:
        raise UserError(f"--overlay makes a plan; {given} holds its K already")
    if given and (args.head_bits, args.drafter_bits) != (AllocationSettings.head_bits, AllocationSettings.drafter_bits):
        raise UserError(f"--head-bits and --drafter-bits make a plan; {given} is one already (its K map decides)")
    if given and (args.expert_layout, args.half_rates) != (None, None):
        raise UserError(f"--expert-layout and --half-rates make a plan; {given} is one already (its K map decides)")
    if not args.tune and (args.tune_steps, args.tune_inputs, args.tune_target) != (None, None, None):
        raise UserError("--tune-steps, --tune-inputs and --tune-target set the tune stage; add --tune")
    if args.tune_e2e_steps is not None and not args.tune_e2e:
        raise UserError("--tune-e2e-steps sets end-to-end tuning; add --tune-e2e")


def _plan_file(args: argparse.Namespace) -> Plan | None:
    if not args.plan:
        return None
    plan = Plan.load(args.plan)
    if args.codebook and args.codebook != plan.codebook:
        raise UserError(f"--codebook {args.codebook} conflicts with {args.plan}, which uses {plan.codebook}")
    return plan


def _recipe_plan(args: argparse.Namespace, cfg, asked: LoaderProfile | None) -> Plan | None:
    """--recipe read for the profile it names (else --loader's, else the one whose rules it meets)."""
    if not args.recipe:
        return None
    recipe = read_recipe(args.recipe)
    if recipe.profile:
        check_loader(asked, recipe.profile, str(args.recipe))
    plan = plan_from_recipe(cfg, recipe, args.codebook or "mul1", asked, args.sparks)
    if current().main and not recipe.profile and not asked:
        print(f"{args.recipe}{profile_note(cfg, recipe, plan, args.sparks)}", file=sys.stderr)
    return plan


def _tune(args: argparse.Namespace) -> TuneSettings | None:
    if not args.tune:
        return None
    return TuneSettings(steps=args.tune_steps or TuneSettings.steps, inputs=args.tune_inputs or TuneSettings.inputs,
                        target=args.tune_target or TuneSettings.target)


def rebuild_command(argv: list[str]) -> tuple[str, ...]:
    """The build command as the pack's card gives it: `--out PACK` and no --work, since where the pack
    and its work directory go is the rebuilder's choice, and a pack must not differ by where it was
    written (the same build into two places gives byte-identical packs)."""
    command, skip = ["quantizer"], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in ("--out", "--work"):
            skip = not eq
            command += ["--out", "PACK"] if flag == "--out" else []
            continue
        command.append(arg)
    return tuple(command)
