"""A finished build in the lines a person reads: the pack's size and bits, the plan, calibration,
proxy errors, tuning, the fit per Spark count, verify's verdict and how to point the engine at it."""

from __future__ import annotations

import shlex
from pathlib import Path

from quantizer.orchestrate.stages import BuildResult, plan_files
from quantizer.exl3 import k_words
from quantizer.fit.render import render as render_fit
from quantizer.pack.card import bits_text
from quantizer.pack.fit_table import pack_fit_table
from quantizer.report import gib, table


def build_summary(r: BuildResult) -> str:
    """What was built, how it fits, and how to run it: the lines `build` ends with."""
    m = r.manifest
    pack_bytes = sum(s.bytes for s in m.shards)
    rows = [[cls, f"{t['tensors']:,}", f"{t['bytes']:,}", gib(t["bytes"]), "" if t["bpw"] is None else f"{t['bpw']:.3f}"]
            for cls, t in m.totals.items()]
    hist = ", ".join(f"K{k}: {n:,}" for k, n in m.quantization["k_histogram"].items())
    lines = [
        f"built {r.out} in {r.seconds:,.1f} s ({r.quantized.units - r.quantized.resumed_units:,} of "
        f"{r.quantized.units:,} units encoded this run)",
        f"{len(m.shards)} shards, {pack_bytes:,} bytes ({gib(pack_bytes)} GiB); {bits_text(m)}; "
        f"head {k_words(r.plan.head_bits)}",
        "plan: {}; saved as {} and {}".format(r.plan.made_by or "the plan file given", *plan_files(r.work, r.out)),
        _calibration_line(r),
        f"linears by K (16 = fp16): {hist or 'none'}",
        _proxy_line(r.quantized.proxy_err),
        *_tune_lines(r),
        *_end_to_end_line(r),
        table(["class", "tensors", "bytes", "GiB", "stored bits/param"], rows),
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
                     f"mapped file); load them before the recipe's launcher: {export_line(r.out / launch['file'])}")
    return lines


def _calibration_line(r: BuildResult) -> str:
    c = r.calibration_summary
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


def _fit_lines(table: dict) -> str:
    """One line per topology: per engine, whether the pack fits at the context and streams it was planned for
    (else the model's full context), else the most it fits."""
    fit = table.get("planned") or table
    what = "planned for" if "planned" in table else "the model's full context"
    lines = [f"fit at {fit['context']:,} tokens x {fit['streams']} stream(s), {what} ({fit['hardware']}, engram "
             f"{fit['engram']}):"]
    for sparks, engines in fit["topologies"].items():
        verdicts = [
            f"{engine} {'fits' if r['fits'] else 'no'}" + ("" if r["fits"] else f" (up to {r['max_context']:,} tokens)")
            + (f"; decode ~{r['decode']['tokens_per_second']:.1f} tokens/s (a model)" if r.get("decode") else "")
            for engine, r in engines.items()
        ]
        lines.append(f"  {sparks} Spark{'s' if sparks != '1' else ''}: " + ", ".join(verdicts))
    return "\n".join(lines)


def export_line(env: Path) -> str:
    """The shell line that exports `env`'s settings, the path quoted: a pack path may hold spaces or `$(...)`."""
    return f"set -a; . {shlex.quote(str(env))}; set +a"
