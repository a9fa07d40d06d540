"""`quantizer build SRC (--bpw B | --sparks N [--context C] [--cold-share S] | --plan PLAN.json) --out PACK
[--method ours|uniform|exl3] [--loader vllm-exl3|tensorfold|exllamav3|exllamav3-v41] [--overlay [GROUPS]]
[--text FILE | --tokens FILE | --no-calibrate] ...`

Calibrates (the shipped calibration set by default), plans, quantizes, packs and verifies. Rerun the
same command after an interruption and it continues where it stopped; a rerun with a different
source, plan or settings is refused with the difference named.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from quantizer.build.stages import PLAN_FILE, RECIPE_FILE, BuildRequest, BuildResult, build
from quantizer.calibrate.rows import calibration_rows
from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS, CalibrationSettings
from quantizer.checkpoint.source import Checkpoint
from quantizer.commands.arguments import (
    add_expert_hessians,
    add_one_spark_arguments,
    count,
    overlay_of,
    repo_id,
    revision,
    tokens,
)
from quantizer.contract.loader_profiles import LOADERS, default_loader, load_profile
from quantizer.contract.plan import Plan
from quantizer.distributed import current
from quantizer.errors import UserError
from quantizer.exl3 import CODEBOOKS
from quantizer.fit.cold_experts import check_share
from quantizer.fit.memory import TOPOLOGIES, pack_fit_table
from quantizer.fit.render import render as render_fit
from quantizer.fit.target import FitTarget
from quantizer.pack.writer import DEFAULT_SHARD_SIZE
from quantizer.plan.allocate import AllocationSettings
from quantizer.plan.methods import METHODS, OURS
from quantizer.quantize.settings import DEVICES, ENCODERS, QuantizeSettings
from quantizer.report import gib, table
from quantizer.tune.settings import INPUTS, TARGETS, EndToEndSettings, TuneSettings

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="plan, quantize, pack and verify in one resumable work directory")
    p.add_argument("src", help="native checkpoint directory or Hugging Face repo id")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--bpw", type=float, help="bits per weight over the budgeted tensors (exllamav3 accounting)")
    rate.add_argument("--sparks", type=int, choices=TOPOLOGIES, help="the most bits whose pack fits N DGX Sparks")
    rate.add_argument("--plan", type=Path, help="a plan file written by `quantizer plan`")
    p.add_argument("--context", type=tokens, help="with --sparks: tokens per stream (default: the model's max positions)")
    p.add_argument("--streams", type=count, default=1, help="with --sparks: concurrent streams (default 1)")
    p.add_argument("--engine", help="with --sparks: engine profile (default: the hardware file's default_engine)")
    p.add_argument("--method", choices=METHODS, default=OURS,
                   help="ours: the allocator on the calibration (default); uniform; exl3: exllamav3's own allocator")
    p.add_argument("--loader", choices=LOADERS,
                   help="engine profile the pack must load in (docs/loader-profiles.md): vllm-exl3 (vLLM + vllm-exl3, "
                        "routed experts EXL3 with K per expert; default for V4.1), exllamav3-v41 (native ExLlamaV3's "
                        "V4.1 loader on one Spark: routed K1..K8, the rest source form or --overlay, launch.env; default "
                        "for V4.1 with --sparks 1), tensorfold (every linear EXL3 mul1, Engram tables in <out>-Engram) or "
                        "exllamav3 (stock 1.6.5; default for V4); the pack is verified against it")
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
    p.add_argument("--out", type=Path, required=True, help="pack directory to write (must not exist)")
    p.add_argument("--work", type=Path, help="work directory (default: <out>.work); rerun to resume, or share it "
                                              "between builds of one source and settings: encodings are reused")
    p.add_argument("--measured-errors", action="store_true",
                   help="ours: allocate on the proxy errors measured by the encodings already in --work (earlier "
                        "builds sharing it) instead of the model's estimate for those (tensor, K); costs a header read")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu: our codec; cuda: exllamav3")
    p.add_argument("--encoder", choices=ENCODERS, default="fast", help="CPU encoder's Viterbi mode")
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
    calibration = CalibrationSettings(device=args.device, row_chunk=args.row_chunk, expert_hessians=args.expert_hessians)
    plan = Plan.load(args.plan) if args.plan else None
    if plan and args.codebook and args.codebook != plan.codebook:
        raise UserError(f"--codebook {args.codebook} conflicts with {args.plan}, which uses {plan.codebook}")
    if args.sparks is None and (args.context is not None or args.streams != 1 or args.engine or args.cold_share):
        raise UserError("--context, --streams, --engine and --cold-share size the fit of --sparks N; add --sparks")
    check_share(args.cold_share)
    if args.cold_share and (args.no_calibrate or args.method != OURS):
        raise UserError("--cold-share picks cold experts by the calibration's routing: use --method ours with "
                        "calibration")
    ck = Checkpoint.open(args.src, revision=args.revision)
    loader = plan.profile.name if plan else args.loader or default_loader(ck.config, args.sparks)
    if plan and args.loader and args.loader != plan.profile.name:
        raise UserError(f"--loader {args.loader} conflicts with {args.plan}, which is made for {plan.profile.name}")
    if plan and args.overlay is not None:
        raise UserError(f"--overlay makes a plan; {args.plan} is one already (its K map decides)")
    profile = load_profile(loader)
    if args.sparks:
        profile.check_sparks(args.sparks)
    overlay = overlay_of(args, profile, args.codebook or "mul1")
    if not args.tune and (args.tune_steps, args.tune_inputs, args.tune_target) != (None, None, None):
        raise UserError("--tune-steps, --tune-inputs and --tune-target set the tune stage; add --tune")
    if args.tune_e2e_steps is not None and not args.tune_e2e:
        raise UserError("--tune-e2e-steps sets end-to-end tuning; add --tune-e2e")
    target = None
    if args.sparks:
        context = ck.config.max_position_embeddings if args.context is None else args.context
        target = FitTarget(args.sparks, context, args.streams, args.engine or profile.fit_engine, args.cold_share)
    rows = None if args.no_calibrate else calibration_rows(ck, args.text, args.tokens, args.calib_rows, args.calib_cols)
    req = BuildRequest(
        src=args.src, out=args.out, bpw=args.bpw, plan=plan, target=target, method=args.method,
        allocation=AllocationSettings(loader=loader, codebook=args.codebook or "mul1", overlay=overlay),
        calibration_rows=rows,
        calibration=calibration, work=args.work, revision=args.revision,
        shard_size=args.shard_size, quantize=QuantizeSettings(seed=args.seed, device=args.device, encoder=args.encoder),
        measured_from_work=args.measured_errors,
        plan_file=args.plan,
        base_model=args.base_model or (None if Path(args.src).expanduser().exists() else args.src),
        command=rebuild_command(args.argv),
        tune=TuneSettings(steps=args.tune_steps or TuneSettings.steps, inputs=args.tune_inputs or TuneSettings.inputs,
                          target=args.tune_target or TuneSettings.target) if args.tune else None,
        end_to_end=EndToEndSettings(steps=args.tune_e2e_steps or EndToEndSettings.steps) if args.tune_e2e else None,
    )
    result = build(req)
    if current().main:
        print(summary(result))
    return 1 if result.fit and not result.fit.fits else 0


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


def summary(r: BuildResult) -> str:
    m = r.manifest
    pack_bytes = sum(s.bytes for s in m.shards)
    rows = [[cls, f"{t['tensors']:,}", f"{t['bytes']:,}", gib(t["bytes"]), "" if t["bpw"] is None else f"{t['bpw']:.3f}"]
            for cls, t in m.totals.items()]
    hist = ", ".join(f"K{k}: {n:,}" for k, n in m.quantization["k_histogram"].items())
    lines = [
        f"built {r.out} in {r.seconds:,.1f} s ({r.quantized.units - r.quantized.resumed_units:,} of "
        f"{r.quantized.units:,} units encoded this run)",
        f"{len(m.shards)} shards, {pack_bytes:,} bytes ({gib(pack_bytes)} GiB); bits {m.quantization['bits']}, "
        f"bpw {m.quantization['bpw']}, head_bits {m.plan['head_bits']}, codebook {m.plan['codebook']}",
        f"plan: {r.plan.made_by}; {r.plan.achieved_bpw:.4f} bits over the budgeted tensors; saved as "
        f"{r.work / PLAN_FILE} and {r.work / RECIPE_FILE}",
        _calibration_line(r),
        f"linears by K (16 = fp16): {hist or 'none'}",
        _proxy_line(r.quantized.proxy_err),
        *_tune_lines(r),
        *_end_to_end_line(r),
        table(["class", "tensors", "bytes", "GiB", "bpw"], rows),
        _fit_lines(pack_fit_table(r.out)),
        *([] if r.fit is None else [render_fit(r.fit)]),
        f"verify: clean ({len(r.verify.findings)} checks)",
        *_engine_lines(r),
        f"work directory {r.work} is kept (re-pack or resume from it); delete it when done",
    ]
    return "\n".join(lines)


def _engine_lines(r: BuildResult) -> list[str]:
    """How to point the plan's engine at the pack (and at its Engram directory, where it has one)."""
    engram = r.manifest.plan.get("engram_dir")
    lines = [f"engine: {r.plan.profile.engine.split(':')[0]} (loader profile {r.plan.profile.name})"]
    if engram:
        where = r.out.parent / engram["dir"]
        lines.append(f"Engram tables: {engram['tables']} tensors in {len(engram['shards'])} source shard(s) linked into "
                     f"{where}; point TensorFold at it: --engram {where} (or TF_DS_ENGRAM={where}), "
                     f"the model at {r.out}")
    launch = r.manifest.plan.get("launch")
    if launch:
        lines.append(f"launch settings: {r.out / launch['file']} ({launch['cold_experts']} cold experts served from the "
                     f"mapped file); load them before the recipe's launcher: set -a; . {r.out / launch['file']}; set +a")
    return lines


def _calibration_line(r: BuildResult) -> str:
    c = r.calibration
    if c is None:
        return "calibration: none (linears quantized without Hessians)"
    return f"calibration: {c.rows} rows x {c.cols} tokens, site sensitivity {c.gains}"


def _tune_lines(r: BuildResult) -> list[str]:
    t = r.tuned
    if t is None:
        return []
    ratios = [a / max(e, 1e-30) for e, a in t.errors.values()]
    mean = sum(ratios) / len(ratios) if ratios else 1.0
    return [f"tune: {t.blocks} blocks ({t.tuned} this run) on {t.tune_rows} rows, {t.heldout_rows} held out; held-out "
            f"block-output MSE x{mean:.3f} on average (tuned / stored scales)"]


def _end_to_end_line(r: BuildResult) -> list[str]:
    e = r.end_to_end
    if e is None:
        return []
    return [f"tune-e2e: {e.steps} steps ({'this run' if e.tuned else 'reused'}) on {e.tune_rows} rows, {e.heldout_rows} "
            f"held out; held-out KL {e.kl_before:.4g} -> {e.kl_after:.4g} (x{e.kl_after / max(e.kl_before, 1e-30):.3f})"]


def _proxy_line(proxy_err: dict[str, float | None]) -> str:
    errors = {k: e for k, e in proxy_err.items() if e is not None}
    if not errors:
        return "proxy error: no encoded linears"
    worst = max(errors, key=errors.get)
    return (f"proxy error tr(EHE')/tr(WHW') (relative MSE when uncalibrated): mean {sum(errors.values()) / len(errors):.4g}, "
            f"worst {errors[worst]:.4g} ({worst})")


def _fit_lines(fit: dict) -> str:
    """One line per topology: per engine, whether the pack fits at the model's context, else the most it fits."""
    lines = [f"fit at {fit['context']:,} tokens per stream ({fit['hardware']}, engram {fit['engram']}):"]
    for sparks, engines in fit["topologies"].items():
        verdicts = [
            f"{engine} {'fits' if r['fits'] else 'no'}" + ("" if r["fits"] else f" (up to {r['max_context']:,} tokens)")
            for engine, r in engines.items()
        ]
        lines.append(f"  {sparks} Spark{'s' if sparks != '1' else ''}: " + (", ".join(verdicts) or "no engine runs here"))
    return "\n".join(lines)
