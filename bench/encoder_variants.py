"""exllamav3's generic and optimized Viterbi tile kernels and our encoder on one GPU, and where the time goes.

Issue 39's first step: measure before writing. On the 16 real-shape V4.1 routed experts of
bench/quantize_gpu.py (bench/v41_experts.py: w1, in 5120 and out 2304, by default; --shape w2), with the
same Hessians and seeds, for each K of --ks (mul1 codebook):

- `quantize_exl3_batch` with the generic tile kernel (EXL3_QT_OPTIMIZED=0, what an H200 runs by default) and
  with exllamav3's dense kernels tuned on sm_120 (EXL3_QT_OPTIMIZED=1): a warm-up (two experts cut to 256
  inputs: the same kernels and scratch), then --repeat timed calls (torch.cuda.synchronize and perf_counter
  around the whole call), in weights/s. exllamav3 reads the variable on every launch (quantize.cu,
  quantize_tiles_use_optimized: std::getenv, nothing cached) but keeps its scratch buffers, laid out for the
  kernel of their first use, in an lru_cache (quantize.py, get_temp_buffers); the bench clears that cache at
  each switch and asks the extension (quantize_tiles_scratch, the launcher's own choice) which kernel it
  will launch, so both variants run in this one process. Half-integer K runs the frac kernel, which the
  variable does not reach: measured once, as `frac`.
- `ours` (--variants): our batch loop (quantizer/codec/exllamav3_batch.py) with our tile kernel, the stage's
  `--encoder ours`; at half-integer K our loop around exllamav3's frac kernel. Compared with generic (or frac).
- Whether two variants give the same codes: torch.equal of every expert's trellis, the count of 16x16 tiles whose
  codes differ, and whether suh, svh, the proxy error and the global scale match.
- Where the time goes, in every first timed call: the parts of `quantize_exl3_batch` (the exllamav3 functions
  it calls: Hessian finalization and its block LDL, regularization, the scale search and its Viterbi calls,
  the LDLQ recursion and its Viterbi calls, the proxy error, the scale refit, packing; for ours also our own
  Hessian finalization and block LDL), each a span on the
  GPU timeline between CUDA events recorded as the function is entered and left (no synchronization; self
  time: less the parts called inside it); `other` is the wall time no part covers (copies of L and H,
  host work).
- After all timed calls, one more generic (or frac) call at each --profile-ks (default K 3) under
  torch.profiler with CUDA activities: device time grouped by kernel name (the Viterbi tile kernels, GEMMs,
  Cholesky / inverse / solve, elementwise and indexing, copies), as shares of the kernel time and of the
  call's wall time; its codes are compared with the timed call's (run to run).

On the GPU machine (about 2.5 minutes for K 2, 3, 4: each full call on 16 w1 experts takes 14-16 s at the
12-14 M weights/s measured before; --experts, --ks and --profile-ks cut it, --repeat 2 adds 1.5 minutes):

    source .device-cache/setup.sh && python bench/encoder_variants.py

writes $OUT/encoder_variants.json (or --json PATH) after every K. Without a CUDA device or exllamav3 it says
so in one line and exits 2; a run that fails is recorded with its error and the others go on (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from v41_experts import EXPERTS, IN, OUT, W1_HESSIANS, encode, w1_hessians, w2_hessians, w2_weights, write_source

from quantizer.report import table

ENV = "EXL3_QT_OPTIMIZED"
QUANTIZE_MODULE = "exllamav3.modules.quant.exl3_lib.quantize"
OURS = "ours"
VARIANTS = ("generic", "optimized", OURS)
FRAC = "frac"
# (faster, reference) pairs compared where both ran at a K
PAIRS = (("optimized", "generic"), (OURS, "generic"), (OURS, FRAC))
OUR_LOOP_MODULE = "quantizer.codec.exllamav3_batch"
# Our batch loop's own steps (the exllamav3 functions it calls are timed under PARTS)
OUR_PARTS = {"_finalize": "Hessian: finalize (ours)", "_unit_blocks": "block LDL"}
SHAPES = {"w1": (IN, OUT), "w2": (OUT, IN)}  # (in_features, out_features)
# The warm-up: two experts (distinct Hessians take the batched path the timed call takes) cut to their first
# 256 inputs (the same K, tiles per LDLQ step and kernels at a tenth of the steps: a fraction of a second)
WARMUP_EXPERTS, WARMUP_IN = 2, 256

# The exllamav3 functions `quantize_exl3_batch` calls (module globals of QUANTIZE_MODULE, looked up at call
# time, so wrapping them times them), and the part each is counted under
VITERBI = "Viterbi"
PARTS = {
    "finalize_capture_H": "Hessian: finalize",
    "block_ldl": "block LDL",
    "regularize": "regularize",
    "sample_scale_tiles": "scale search: sample",
    "g_scale_search_batch": "scale search",
    "ldlq_batched": "LDLQ",
    "ldlq": "LDLQ",
    "quantize_tiles_multigpu": VITERBI,
    "block_trace": "proxy error",
    "preapply_had_l": "refit: Hadamard",
    "preapply_had_r": "refit: Hadamard",
    "unrotate_H": "refit: unrotate H",
    "refit_scales": "refit: scales",
    "pack_trellis": "pack",
}
OTHER_PART = "other (no part: copies of L and H, host work)"

# Kernel name -> group, first match wins (lower-case substrings of the demangled name)
VITERBI_GROUP = "Viterbi (quantize_tiles kernels)"
OTHER_GROUP = "other"
KERNEL_GROUPS = (
    (VITERBI_GROUP, ("quantize_tiles",)),
    ("pack (exllamav3)", ("pack_trellis", "pack_signs")),
    ("Cholesky, inverse, solve", ("potrf", "potrs", "getrf", "getrs", "getri", "trsm", "trsv", "syrk", "herk",
                                  "laswp", "cholesky", "magma", "cusolver", "matinv")),
    ("GEMM (LDLQ feedback, Hadamard, refit, proxy)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk",
                                                      "dot_kernel")),
    ("memcpy, memset", ("memcpy", "memset")),
    ("elementwise, reductions, indexing", ("elementwise", "reduce", "index", "catarray", "copy", "gather", "scatter",
                                           "fill", "where", "sort", "topk", "radix", "arange", "triu", "tril")),
)


class Parts:
    """Times the parts of one `quantize_exl3_batch` call: while entered, each function of `names` in `module` is
    wrapped so that its calls are spans between two events recorded on the current stream (CUDA events by
    default: the GPU timeline, no synchronization), nested in the part that called them. `summary()` after
    the call has synchronized."""

    def __init__(self, module, names: dict[str, str] = PARTS, event=None, also=()):
        self.targets = [(module, dict(names))] + [(m, dict(n)) for m, n in also]  # also: more (module, names)
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.spans: list[dict] = []
        self.missing: list[str] = []
        self._stack: list[int] = []
        self._saved: list[tuple] = []

    def __enter__(self) -> Parts:
        for module, names in self.targets:
            for attr, label in names.items():
                fn = getattr(module, attr, None)
                if not callable(fn):
                    self.missing.append(attr)
                    continue
                self._saved.append((module, attr, fn))
                setattr(module, attr, self._wrap(fn, label))
        return self

    def __exit__(self, *exc) -> bool:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved = []
        return False

    def _wrap(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            parent = self._stack[-1] if self._stack else None
            path = (self.spans[parent]["path"] if parent is not None else ()) + (label,)
            tiles = int(args[0].shape[0]) if label == VITERBI and args and hasattr(args[0], "shape") else 0
            span = {"path": path, "parent": parent, "start": self.event(), "end": self.event(), "tiles": tiles}
            self._stack.append(len(self.spans))
            self.spans.append(span)
            span["start"].record()
            try:
                return fn(*args, **kwargs)
            finally:
                span["end"].record()
                self._stack.pop()
        return timed

    def summary(self, wall_s: float) -> list[dict]:
        """One row per part (its path of nested labels), in first-call order: calls, tiles (Viterbi), seconds
        (spans less the parts nested in them) and share of `wall_s`; then `other`, the wall time no top-level
        part covers."""
        total = [s["start"].elapsed_time(s["end"]) / 1e3 for s in self.spans]  # elapsed_time: milliseconds
        own = list(total)
        for i, s in enumerate(self.spans):
            if s["parent"] is not None:
                own[s["parent"]] -= total[i]
        rows: dict[tuple, dict] = {}
        for i, s in enumerate(self.spans):
            r = rows.setdefault(s["path"], {"part": " / ".join(s["path"]), "depth": len(s["path"]) - 1,
                                            "calls": 0, "tiles": 0, "seconds": 0.0})
            r["calls"] += 1
            r["tiles"] += s["tiles"]
            r["seconds"] += own[i]
        top = sum(t for t, s in zip(total, self.spans) if s["parent"] is None)
        out = list(rows.values()) + [{"part": OTHER_PART, "depth": 0, "calls": 0, "tiles": 0,
                                      "seconds": wall_s - top}]
        for r in out:
            r["share_of_wall"] = r["seconds"] / wall_s if wall_s > 0 else 0.0
        return out


def viterbi_seconds(parts: list[dict]) -> float:
    """The seconds of every Viterbi part (under the scale search and under LDLQ)."""
    return sum(r["seconds"] for r in parts if r["part"].split(" / ")[-1] == VITERBI)


def kernel_group(name: str) -> str:
    """The group of a CUDA kernel (or memcpy / memset) by its demangled name."""
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return OTHER_GROUP


def short_name(name: str, width: int = 100) -> str:
    """A demangled kernel name without `void `, its parameter list and anonymous namespaces, cut to `width`."""
    name = name.replace("(anonymous namespace)::", "")
    name = name[5:] if name.startswith("void ") else name
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0 and i > 0:
            name = name[:i]
            break
    return name if len(name) <= width else name[: width - 3] + "..."


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals in microseconds, in seconds."""
    busy, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy / 1e6


def summarize_kernels(kernels: list[tuple[str, float, float]], wall_s: float, top: int = 3) -> dict:
    """Device time of (name, start_us, end_us) kernels by group: each group's seconds, its share of the summed
    kernel time and of `wall_s`, its kernel count and largest kernels; the GPU's busy time (the union: streams
    may overlap), the distinct Viterbi kernels and the ten largest kernels overall."""
    groups: dict[str, dict] = {}
    names: dict[str, list] = {}
    for name, start, end in kernels:
        g = groups.setdefault(kernel_group(name), {"us": 0.0, "count": 0, "names": {}})
        g["us"] += end - start
        g["count"] += 1
        for d in (g["names"], names):
            n = d.setdefault(short_name(name), [0.0, 0])
            n[0] += end - start
            n[1] += 1
    kernel_us = sum(g["us"] for g in groups.values())

    def largest(d: dict, k: int) -> list[dict]:
        return [{"name": n, "seconds": us / 1e6, "count": c} for n, (us, c) in sorted(d.items(), key=lambda x: -x[1][0])[:k]]

    rows = [{"group": group, "seconds": g["us"] / 1e6, "share_of_kernel_time": g["us"] / kernel_us if kernel_us else 0.0,
             "share_of_wall": g["us"] / 1e6 / wall_s if wall_s > 0 else 0.0, "kernels": g["count"],
             "largest": largest(g["names"], top)}
            for group, g in sorted(groups.items(), key=lambda x: -x[1]["us"])]
    return {"wall_s": wall_s, "kernel_s": kernel_us / 1e6, "busy_s": busy_seconds([(s, e) for _, s, e in kernels]),
            "kernels": len(kernels), "groups": rows,
            "viterbi_kernels": sorted(groups.get(VITERBI_GROUP, {"names": {}})["names"]),
            "largest_kernels": largest(names, 10)}


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every device activity (kernels, memcpy, memset) a torch.profiler recorded."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profiled(call) -> tuple[object, dict]:
    """`call()` under torch.profiler with CUDA activities: its result and the kernel summary of its first
    element (seconds) as wall time, or {"error": ...} where the profiler failed (the call still runs; an
    error of the call itself is raised)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.start()
    except Exception as e:  # noqa: BLE001 - the profiler is optional here: say why and run the call without it
        return call(), {"error": f"the profiler did not start: {type(e).__name__}: {e}"}
    try:
        out = call()
    finally:
        try:
            prof.stop()
        except Exception as e:  # noqa: BLE001 - a failed stop must not hide the call's own error
            stop_error = f"the profiler did not stop: {type(e).__name__}: {e}"
        else:
            stop_error = None
    if stop_error:
        return out, {"error": stop_error}
    try:
        kernels = kernel_events(prof)
    except Exception as e:  # noqa: BLE001 - an unreadable profile is reported, the measurements go on
        return out, {"error": f"the profile could not be read: {type(e).__name__}: {e}"}
    if not kernels:
        return out, {"error": "the profiler recorded no CUDA kernels (CUPTI unavailable?)"}
    return out, summarize_kernels(kernels, out[0])


def compare(a: list, b: list, a_args: list[dict] | None = None, b_args: list[dict] | None = None) -> dict:
    """Two `quantize_exl3_batch` results on the same inputs ((proxy error, {suh, svh, trellis}) per tensor):
    whether every trellis is equal (torch.equal), how many 16x16 tiles' codes differ (a trellis is [tiles_k,
    tiles_n, words]), in how many tensors, and whether suh, svh, the proxy error and the global scale match."""
    tiles = differing = tensors = 0
    suh = svh = proxy = True
    rel = 0.0
    for (pa, ta), (pb, tb) in zip(a, b):
        ca, cb = ta["trellis"], tb["trellis"]
        n = ca.numel() // ca.shape[-1]
        tiles += n
        if ca.shape != cb.shape:
            d = n
        else:
            d = 0 if torch.equal(ca, cb) else int((ca != cb).reshape(n, ca.shape[-1]).any(-1).sum())
        differing += d
        tensors += d > 0
        suh &= torch.equal(ta["suh"], tb["suh"])
        svh &= torch.equal(ta["svh"], tb["svh"])
        proxy &= pa == pb
        rel = max(rel, abs(pa - pb) / max(abs(pb), 1e-30))
    g_scale = None if a_args is None or b_args is None else all(x.get("g_scale") == y.get("g_scale")
                                                                 for x, y in zip(a_args, b_args))
    return {"codes_equal": differing == 0 and len(a) == len(b), "differing_tiles": differing, "tiles": tiles,
            "tensors_differing": tensors, "tensors": len(a), "suh_equal": suh, "svh_equal": svh,
            "proxy_equal": proxy, "proxy_max_rel_diff": rel, "g_scale_equal": g_scale,
            "proxy_mean": [sum(p for p, _ in a) / max(len(a), 1), sum(p for p, _ in b) / max(len(b), 1)]}


def quantize_module():
    return importlib.import_module(QUANTIZE_MODULE)


@contextlib.contextmanager
def kernel_variant(variant: str, K: float, device: torch.device):
    """EXL3_QT_OPTIMIZED set for `variant` (0 generic, 1 optimized; untouched for frac) and exllamav3's scratch
    cache cleared, at entry and at exit (the variable restored); yields what the extension says it will
    launch at this K ({"optimized": bool, "wave": tiles resident per wave}; {} for frac), and refuses a variant
    the extension does not take up. `ours`: our batch loop (its "convert") with our tile kernel standing in
    for exllamav3's at integer K, exllamav3's frac kernel at half-integer K."""
    if variant == OURS:
        from quantizer.codec import kernel
        from quantizer.codec.exllamav3_batch import quantize_exl3_batch_on_device

        with kernel_variant(FRAC if not float(K).is_integer() else "generic", K, device) as info:
            with kernel.in_exllamav3() if float(K).is_integer() else contextlib.nullcontext():
                yield {**info, "kernel": "ours" if float(K).is_integer() else FRAC,
                       "convert": quantize_exl3_batch_on_device}
        return
    q = quantize_module()
    before = os.environ.get(ENV)
    if variant != FRAC:
        os.environ[ENV] = "1" if variant == "optimized" else "0"
    q.get_temp_buffers.cache_clear()  # laid out for the kernel of its first call (see the module docstring)
    try:
        info = {}
        if variant != FRAC:
            optimized, wave = q.ext.quantize_tiles_scratch(device.index or 0, int(K), False, True, 256)
            if bool(optimized) != (variant == "optimized"):
                raise RuntimeError(f"{ENV}={os.environ[ENV]}: exllamav3 would launch the "
                                   f"{'optimized' if optimized else 'generic'} kernel at K {K:g}, not the {variant}")
            info = {"optimized": bool(optimized), "wave": int(wave)}
        yield info
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        q.get_temp_buffers.cache_clear()


def warmup_inputs(weights, hessians):
    """The warm-up's weights and Hessians: the first WARMUP_EXPERTS experts, their first WARMUP_IN inputs
    (a principal block of an SPD Hessian is SPD)."""
    def cut(h):
        return h[0][:WARMUP_IN, :WARMUP_IN].contiguous(), h[1]

    return ([w[:, :WARMUP_IN] for w in weights[:WARMUP_EXPERTS]],
            cut(hessians) if isinstance(hessians, tuple) else [cut(h) for h in hessians[:WARMUP_EXPERTS]])


def variants_for(K: float, chosen=VARIANTS) -> tuple[str, ...]:
    """The chosen variants that run at K: generic, optimized and ours at integer K; frac and ours at a half."""
    return tuple(v for v in (VARIANTS if float(K).is_integer() else (FRAC, OURS)) if v in chosen or v == FRAC)


def record_parts(run: dict, recorder: Parts, seconds: float) -> None:
    """The parts of the run's first timed call into `run` (or why they could not be read)."""
    try:
        run["parts"] = recorder.summary(seconds)
    except Exception as e:  # noqa: BLE001 - the parts are an extra: the run's timing stands without them
        run["parts_error"] = f"{type(e).__name__}: {e}"
        return
    run["viterbi_s"] = viterbi_seconds(run["parts"])
    if recorder.missing:
        run["parts_missing"] = recorder.missing


def compare_variants(K: float, runs: dict, outputs: dict, faster: str, reference: str) -> dict:
    """One variant's run against a reference run at K: speeds (reference time over its time, for the whole
    call and the Viterbi parts) and the `compare` of their outputs."""
    r, f = runs[reference], runs[faster]
    c = {"K": K, "variant": faster, "reference": reference, "speed": r["best_s"] / f["best_s"]}
    if f.get("viterbi_s", 0) > 0 and "viterbi_s" in r:
        c["viterbi_speed"] = r["viterbi_s"] / f["viterbi_s"]
    return {**c, **compare(outputs[reference][0], outputs[faster][0], outputs[reference][1], outputs[faster][1])}


def measure(weights, hessians, ks, *, device, repeat=1, profile_ks=(), parts=True, encode=encode,
            variant=kernel_variant, parts_factory=None, save=None, log=print, variants=VARIANTS) -> dict:
    """Every (K, variant) run (a warm-up, then `repeat` timed calls), the variants compared per K; then, after
    every timed call (the profiler then cannot slow any), the profiled calls and their run-to-run comparison
    with the timed call. `save(report)` after every K. A failed run is recorded with its error; the others go on.
    A variant whose context yields a "convert" has `encode` call that function in place of exllamav3's."""
    parts_factory = parts_factory or (lambda: Parts(quantize_module(),
                                                    also=[(importlib.import_module(OUR_LOOP_MODULE), OUR_PARTS)]))
    n_weights = sum(w.numel() for w in weights)
    warm_w, warm_h = warmup_inputs(weights, hessians)
    report = {"runs": [], "comparisons": [], "run_to_run": [], "profiles": [], "errors": []}
    kept = {}  # (K, variant) -> the first timed call's outputs, for the profiled call to be compared with

    def failed(what: str, e: Exception) -> str:
        report["errors"].append(f"{what}: {type(e).__name__}: {e}")
        log(f"{what}: FAILED {type(e).__name__}: {e}")
        return f"{type(e).__name__}: {e}"

    for K in ks:
        outputs = {}
        for v in variants_for(K, variants):
            run = {"K": K, "variant": v}
            report["runs"].append(run)
            try:
                with variant(v, K, device) as info:
                    info = dict(info)
                    convert = info.pop("convert", None)
                    enc = functools.partial(encode, convert=convert) if convert else encode
                    run.update(info)
                    enc(warm_w, warm_h, K, device)
                    seconds, first = [], None
                    for r in range(repeat):
                        recorder = parts_factory() if parts else contextlib.nullcontext()
                        with recorder:
                            sec, res, qa = enc(weights, hessians, K, device)
                        seconds.append(sec)
                        if r == 0:
                            first = (res, qa)
                            if parts:
                                record_parts(run, recorder, sec)
                    run.update({"seconds": seconds, "best_s": min(seconds), "weights_per_s": n_weights / min(seconds)})
                outputs[v] = first
                log(f"K {K:g} {v}: {min(seconds):.2f} s, {n_weights / min(seconds) / 1e6:.2f} M weights/s")
            except Exception as e:  # noqa: BLE001 - one failed run is recorded and the others still measured
                run["error"] = failed(f"K {K:g} {v}", e)
        for faster, reference in PAIRS:
            if faster in outputs and reference in outputs:
                try:
                    report["comparisons"].append(compare_variants(
                        K, {r["variant"]: r for r in report["runs"] if r["K"] == K}, outputs, faster, reference))
                except Exception as e:  # noqa: BLE001 - recorded; the other K still measured
                    failed(f"K {K:g} comparison {faster} / {reference}", e)
        v = variants_for(K, variants)[0]
        if K in profile_ks and v in outputs:
            kept[K, v] = outputs[v]
        outputs.clear()
        if save:
            save(report)

    for (K, v), (res0, qa0) in kept.items():
        log(f"K {K:g} {v}: the call under torch.profiler")
        try:
            with variant(v, K, device):
                (_, res, qa), prof = profiled(lambda: encode(weights, hessians, K, device))
            report["profiles"].append({"K": K, "variant": v, **prof})
            if "error" in prof:
                log(f"K {K:g} {v}: {prof['error']}")
            # the same call twice: equal unless something in the encoder is not deterministic
            report["run_to_run"].append({"K": K, "variant": v, **compare(res0, res, qa0, qa)})
        except Exception as e:  # noqa: BLE001 - recorded; the other profiles still run
            report["profiles"].append({"K": K, "variant": v, "error": failed(f"K {K:g} {v} profiled call", e)})
        if save:
            save(report)
    return report


def yes_no(x) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def print_report(report: dict) -> None:
    runs = report["runs"]
    comps = {(c["K"], c["variant"]): c for c in report["comparisons"]}
    print(f"\n{report.get('experts', '?')} experts {report.get('shape', '')}, mul1, {report.get('device', '')}: "
          "quantize_exl3_batch with exllamav3's generic and optimized tile kernels, and our batch loop and kernel")
    rows = []
    for r in runs:
        c = comps.get((r["K"], r["variant"]))
        if "error" in r:
            rows.append([f"{r['K']:g}", r["variant"], r.get("wave", "-"), "FAILED", "", "", "", "", r["error"][:60]])
            continue
        rows.append([f"{r['K']:g}", r["variant"], r.get("wave", "-"), f"{r['best_s']:.2f}",
                     f"{r['weights_per_s'] / 1e6:.2f}", c["reference"] if c else "",
                     f"{c['speed']:.3f}" if c else "",
                     f"{c['viterbi_speed']:.3f}" if c and "viterbi_speed" in c else "",
                     (yes_no(c["codes_equal"]) + ("" if c["codes_equal"] else
                      f" ({c['differing_tiles']:,} of {c['tiles']:,} tiles)")) if c else ""])
    print(table(["K", "variant", "wave", "seconds", "M weights/s", "against", "speed", "Viterbi speed", "codes equal"],
                rows))
    for c in report["comparisons"]:
        print(f"K {c['K']:g} {c['variant']} / {c['reference']}: suh {yes_no(c['suh_equal'])}, "
              f"svh {yes_no(c['svh_equal'])}, proxy error {yes_no(c['proxy_equal'])} ({c['proxy_mean'][0]:.6g} / "
              f"{c['proxy_mean'][1]:.6g}, max rel diff {c['proxy_max_rel_diff']:.2e}), g_scale {yes_no(c['g_scale_equal'])}")
    for c in report["run_to_run"]:
        print(f"K {c['K']:g} {c['variant']} run to run (the profiled call against the timed one): codes equal "
              f"{yes_no(c['codes_equal'])}" + ("" if c["codes_equal"] else f" ({c['differing_tiles']:,} tiles differ)"))

    for r in runs:
        if "parts_error" in r:
            print(f"K {r['K']:g} {r['variant']}: parts not read: {r['parts_error']}")
    for K in dict.fromkeys(r["K"] for r in runs):
        timed = [r for r in runs if r["K"] == K and "parts" in r]
        if not timed:
            continue
        print(f"\nK {K:g}: parts of the call (GPU-timeline spans, self time; seconds and share of the call's wall time)")
        names = list(dict.fromkeys(p["part"] for r in timed for p in r["parts"]))
        by = [{p["part"]: p for p in r["parts"]} for r in timed]
        rows = []
        for name in names:
            p0 = next(b[name] for b in by if name in b)
            cells = ["  " * p0["depth"] + name.split(" / ")[-1]]
            for b in by:
                p = b.get(name)
                cells += [f"{p['seconds']:.3f}", f"{100 * p['share_of_wall']:.1f}%"] if p else ["", ""]
            cells.append(f"{p0['tiles']:,}" if p0["tiles"] else "")
            rows.append(cells)
        rows.append(["wall"] + sum(([f"{r['seconds'][0]:.3f}", "100%"] for r in timed), []) + [""])
        print(table(["part"] + sum(([r["variant"], "%"] for r in timed), []) + ["tiles"], rows))

    for p in report["profiles"]:
        print(f"\nK {p['K']:g} {p['variant']}: torch.profiler, device time by kernel group")
        if "error" in p:
            print(f"  {p['error']}")
            continue
        print(f"  wall {p['wall_s']:.2f} s, kernel time {p['kernel_s']:.2f} s, GPU busy {p['busy_s']:.2f} s "
              f"({100 * p['busy_s'] / p['wall_s']:.0f}% of wall), {p['kernels']:,} kernels; "
              f"Viterbi kernels: {', '.join(p['viterbi_kernels']) or 'none'}")
        print(table(["group", "seconds", "% kernel time", "% wall", "kernels", "largest"], right={1, 2, 3, 4}, rows=
                    [[g["group"], f"{g['seconds']:.3f}", f"{100 * g['share_of_kernel_time']:.1f}%",
                      f"{100 * g['share_of_wall']:.1f}%", f"{g['kernels']:,}", g["largest"][0]["name"][:60]]
                     for g in p["groups"]]))


def environment_error() -> str | None:
    """Why this machine cannot run the bench, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    try:
        quantize_module()
    except Exception as e:  # noqa: BLE001 - any failure to import exllamav3 (missing, unbuildable extension): one line
        return f"needs exllamav3 (the gpu extra): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=float, nargs="+", default=[2.0, 3.0, 4.0],
                    help="K values (mul1: 1-8, or 1.5, 2.5, 3.5 on the frac kernel, measured once)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="w1", help="w1: in 5120, out 2304; w2: in 2304, out 5120")
    ap.add_argument("--w1-hessians", choices=sorted(W1_HESSIANS), default="each",
                    help="each: one Hessian per expert's w1 (as bench/quantize_gpu.py); shared: one for all")
    ap.add_argument("--experts", type=int, default=EXPERTS, help=f"experts per call (1-{EXPERTS})")
    ap.add_argument("--repeat", type=int, default=1, help="timed calls per K and variant (the best is reported)")
    ap.add_argument("--profile-ks", type=float, nargs="*", default=None,
                    help="K values whose generic (or frac) call runs under torch.profiler (default: 3, or the first "
                         "of --ks; none: no profile)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="integer-K variants to run (a half-integer K runs frac, and ours if chosen)")
    ap.add_argument("--no-parts", action="store_true", help="do not time the parts of the calls")
    ap.add_argument("--json", type=Path, default=None, help="report file (default: $OUT/encoder_variants.json)")
    args = ap.parse_args(argv)
    grid = {1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0}
    if bad := [k for k in args.ks if k not in grid]:
        ap.error(f"--ks {' '.join(f'{k:g}' for k in bad)}: not a mul1 rate (1-8, 1.5, 2.5, 3.5)")
    if not 1 <= args.experts <= EXPERTS:
        ap.error(f"--experts {args.experts}: 1 to {EXPERTS}")
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: 1 or more")
    profile_ks = ([3.0] if 3.0 in args.ks else args.ks[:1]) if args.profile_ks is None else args.profile_ks
    path = args.json or (Path(os.environ["OUT"]) / "encoder_variants.json" if os.environ.get("OUT") else None)
    if path and not path.parent.is_dir():
        ap.error(f"--json {path}: no directory {path.parent}")
    if why := environment_error():
        print(f"encoder_variants: {why}", file=sys.stderr)
        raise SystemExit(2)

    from importlib.metadata import version

    started = time.perf_counter()
    device = torch.device("cuda", 0)
    in_f, out_f = SHAPES[args.shape]
    print(f"building {EXPERTS} {args.shape} experts (in {in_f}, out {out_f}) and their Hessians", flush=True)
    if args.shape == "w1":
        with tempfile.TemporaryDirectory() as tmp:
            weights = write_source(Path(tmp) / "src", device)
        hessians = w1_hessians(device, args.w1_hessians)
        hessian_note = W1_HESSIANS[args.w1_hessians]
    else:
        weights, hessians, hessian_note = w2_weights(device), w2_hessians(device), "one SPD Hessian each"
    weights = weights[: args.experts]
    hessians = hessians if isinstance(hessians, tuple) else hessians[: args.experts]
    header = {"bench": "bench/encoder_variants.py", "device": torch.cuda.get_device_name(device),
              "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
              "torch": torch.__version__, "exllamav3": version("exllamav3"), "env": ENV, "codebook": "mul1",
              "shape": args.shape, "in_features": in_f, "out_features": out_f, "experts": len(weights),
              "weights": sum(w.numel() for w in weights), "hessians": hessian_note, "ks": args.ks,
              "repeat": args.repeat, "profile_ks": profile_ks, "variants": args.variants}

    def save(report: dict) -> None:
        if path:
            path.write_text(json.dumps({**header, **report, "elapsed_s": time.perf_counter() - started}, indent=1) + "\n")

    report = measure(weights, hessians, args.ks, device=device, repeat=args.repeat, profile_ks=profile_ks,
                     parts=not args.no_parts, save=save, log=lambda s: print(s, flush=True), variants=args.variants)
    report = {**header, **report}
    save(report)
    print_report(report)
    print(f"\n{time.perf_counter() - started:.0f} s in all" + (f"; written to {path}" if path else ""))
    if report["errors"]:
        print(f"{len(report['errors'])} run(s) failed:\n  " + "\n  ".join(report["errors"]), file=sys.stderr)
    return report


if __name__ == "__main__":
    raise SystemExit(1 if main()["errors"] else 0)
