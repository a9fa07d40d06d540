"""`quantizer build SRC (--bpw B | --plan PLAN.json) --out PACK [--work DIR] [--device cpu|cuda] ...`

Rerun the same command after an interruption and it continues where it stopped; a rerun with a
different source, plan or settings is refused with the difference named.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from quantizer.build.build import BuildRequest, BuildResult, build
from quantizer.errors import UserError
from quantizer.pack.writer import DEFAULT_SHARD_SIZE
from quantizer.plan.plan import Plan
from quantizer.plan.sizes import CODEBOOKS
from quantizer.quantize.settings import DEVICES, ENCODERS, QuantizeSettings
from quantizer.report import gib, table

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="plan, quantize, pack and verify in one resumable work directory")
    p.add_argument("src", help="native checkpoint directory or Hugging Face repo id")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--bpw", type=float, help="uniform plan at this many bits per weight (exllamav3 accounting)")
    rate.add_argument("--plan", type=Path, help="a plan file written by `quantizer plan`")
    p.add_argument("--out", type=Path, required=True, help="pack directory to write (must not exist)")
    p.add_argument("--work", type=Path, help="work directory (default: <out>.work); rerun to resume")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu: our codec; cuda: exllamav3")
    p.add_argument("--encoder", choices=ENCODERS, default="fast", help="CPU encoder's Viterbi mode")
    p.add_argument("--seed", type=int, default=0, help="job seed; each linear's seed derives from it and its key")
    p.add_argument("--shard-size", type=parse_size, default=DEFAULT_SHARD_SIZE, help="shard cap, e.g. 8G, 512M (default 8G)")
    p.add_argument("--codebook", choices=CODEBOOKS, help="EXL3 codebook of a uniform plan (default mul1)")
    p.add_argument("--revision", help="revision of a Hugging Face repo id")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 8G, 512M or a byte count")
    return int(float(m[1]) * UNITS[m[2].upper()])


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan) if args.plan else None
    if plan and args.codebook and args.codebook != plan.codebook:
        raise UserError(f"--codebook {args.codebook} conflicts with {args.plan}, which uses {plan.codebook}")
    req = BuildRequest(
        src=args.src, out=args.out, bpw=args.bpw, plan=plan, work=args.work,
        codebook=args.codebook or "mul1", revision=args.revision, shard_size=args.shard_size,
        quantize=QuantizeSettings(seed=args.seed, device=args.device, encoder=args.encoder),
    )
    result = build(req)
    print(summary(result))
    return 1 if result.verify.faults else 0


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
        f"linears by K (16 = fp16): {hist or 'none'}",
        _proxy_line(r.quantized.proxy_err),
        table(["class", "tensors", "bytes", "GiB", "bpw"], rows),
        _fit_lines(m),
        f"verify: {'clean' if not r.verify.faults else f'{len(r.verify.faults)} fault(s)'}",
        f"work directory {r.quantized.work} is kept (re-pack or resume from it); delete it when done",
    ]
    lines += [f.line() for f in r.verify.faults]
    return "\n".join(lines)


def _proxy_line(proxy_err: dict[str, float | None]) -> str:
    errors = {k: e for k, e in proxy_err.items() if e is not None}
    if not errors:
        return "proxy error: no encoded linears"
    worst = max(errors, key=errors.get)
    return (f"proxy error tr(EHE')/tr(WHW') (relative MSE when uncalibrated): mean {sum(errors.values()) / len(errors):.4g}, "
            f"worst {errors[worst]:.4g} ({worst})")


def _fit_lines(m) -> str:
    """One line per topology: per engine, whether the pack fits at the model's context, else the most it fits."""
    fit = m.fit
    lines = [f"fit at {fit['context']:,} tokens per stream ({fit['hardware']}, engram {fit['engram']}):"]
    for sparks, engines in fit["topologies"].items():
        verdicts = [
            f"{engine} {'fits' if r['fits'] else 'no'}" + ("" if r["fits"] else f" (up to {r['max_context']:,} tokens)")
            for engine, r in engines.items()
        ]
        lines.append(f"  {sparks} Spark{'s' if sparks != '1' else ''}: " + (", ".join(verdicts) or "no engine runs here"))
    return "\n".join(lines)
