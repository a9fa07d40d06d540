"""A full-width DeepSeek-V4.1-Flash slice built end to end on one GPU, and what the real model would take.

Writes a native checkpoint with the real shapes (hidden 5120, expert width 2304, attention, Engram,
one drafter block, vision) but --layers trunk layers of --experts routed experts, random weights
made on the GPU in the native formats (FP8 + E8M0, MXFP4 experts, BF16). The Engram table keeps its
256-wide rows with far fewer of them (a small hash vocabulary). Then runs `quantizer.orchestrate.stages`,
the call `quantizer build` makes (calibrate -> plan -> quantize -> pack -> verify), and prints per
stage: time, weights/s, peak GPU memory, peak host RAM and disk.

The quantize stage's rate is compared with exllamav3's `quantize_exl3_batch` on the same tensors in
the same run: every kind of unit the stage encoded (a layer's routed w1 / w2 / w3 batch at its K,
each attention linear, the head) is encoded again by a direct call on its first unit (batches cut to
--sample experts, the head to its first rows), with the weights already dequantized on the GPU and
the calibrated Hessians; the stage's units priced at those rates give the direct time (goal:
stage rate >= 0.9 of it). The real model's plan is priced as `plan` prices it (the shipped encode
rates of full-size experts) times the slice's measured over stated quantize time per class of unit
(routed experts, the rest: the stage's own seconds per unit): the projection on 1, 2, 4 and 8 GPUs
(calibration data-parallel, quantize units spread over ranks, pack and verify on one), and the disk its
Hessians, work directory and pack need.

Our encoder kernel is compiled (first use on the machine) or loaded before the build, and that time is
reported on its own: the quantize stage's seconds are the encoding's alone.

Every estimate `build` prints before a stage (calibration's GPU memory, RAM and disk; quantize's RAM, GPU memory,
disk and time; the pack's disk) is computed by the same functions and printed beside what the run
measured, with their ratio (goal 0.75-1.33).

The real model's calibration time is projected from a full-size layer when --layer-rate gives the
JSON bench/calibrate_gpu_layer.py wrote on the same GPU; without it, from the slice's per-layer rate
(a fixed part and a part per token, measured at two row counts) scaled by the experts, an upper bound:
the fixed part holds gate2's per-expert Hessians, which grow with the experts, and the start-up, which
does not (on one H200, 1.63 h against the full-size layer's 0.91).

On the GPU machine (one H200; 64 experts x 2 layers: 5.7 G weights to encode, about 8-9 minutes):

    source .device-cache/setup.sh && OUT=$OUT python bench/calibrate_gpu_layer.py && \\
        python bench/rehearsal.py --layers 2 --experts 64 --bpw 2.9 --layer-rate $OUT/calibrate_gpu_layer.json \\
        --out-json $OUT/rehearsal.json

Everything is written under --tmp (default: the system temporary directory) and deleted at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate_memory  # noqa: E402
from v41_experts import direct  # noqa: E402

from quantizer.orchestrate.preflight import disk_needs  # noqa: E402
from quantizer.orchestrate.stages import BuildRequest, build  # noqa: E402
from quantizer.calibrate.needs import calibration_needs  # noqa: E402
from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.calibrate.stage import calibrate  # noqa: E402
from quantizer.calibrate.storage import HessianStore  # noqa: E402
from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.codec import kernel  # noqa: E402
from quantizer.contract.pack_spec import pack_spec  # noqa: E402
from quantizer.contract.rules import TOTAL, expected_bytes  # noqa: E402
from quantizer.exl3 import exl3_bytes  # noqa: E402
from quantizer.model.layout import native_layout  # noqa: E402
from quantizer.model.streaming import block_weight_bytes  # noqa: E402
from quantizer.plan.uniform import uniform_plan  # noqa: E402
from quantizer.model.targets import ROUTED  # noqa: E402
from quantizer.quantize.encode_hours import RateTable, estimate, plan_estimate  # noqa: E402
from quantizer.quantize.linears import work_units  # noqa: E402
from quantizer.quantize.pipeline import PREFETCH_UNITS  # noqa: E402
from quantizer.quantize.settings import QuantizeSettings  # noqa: E402
from quantizer.quantize.stage import WeightReader, quantize_disk, quantize_gpu_memory, quantize_ram  # noqa: E402
from quantizer.report import GIB, table  # noqa: E402
from quantizer.shipped import model_config_path  # noqa: E402
from quantizer.tiny.make import random_values  # noqa: E402
from quantizer.tiny.native_writer import write_native_checkpoint  # noqa: E402
from quantizer.tune.settings import TuneSettings  # noqa: E402
from quantizer.tune.stage import DTYPE, START_S, block_seconds, tune_memory, tune_seconds  # noqa: E402
from quantizer.tune.store import TunedStore  # noqa: E402

REAL = "deepseek-v4.1-flash.json"
REAL_ROWS, REAL_COLS = 250, 2048  # the calibration a real build runs by default
FULL_LAYER_ROWS = 250  # the rows bench/calibrate_gpu_layer.py projects one layer at
SHARD_BYTES = 2 << 30  # source shards of about this size
HEAD_SAMPLE_WEIGHTS = 64 << 20
GPU_COUNTS = (1, 2, 4, 8)
STAGES = ("calibrate", "plan", "quantize", "pack", "verify")
TUNE_STAGE = "tune"
CLASSES = ("routed experts", "the rest")  # of quantize units, priced apart in the projection


def slice_config(layers: int, experts: int) -> dict:
    """The real config.json with `layers` trunk layers of `experts` experts, one drafter block and one
    Engram layer (layer 1), compressed layers alternating ratio 2 and 1 from layer 0."""
    return calibrate_memory.slice_config(layers, experts, 1)


@dataclass
class StageRecord:
    seconds: float = 0.0
    gpu_peak: int = 0
    gpu_start: int = 0  # allocated when the stage began (what earlier stages left alive)
    ram_peak: int = 0
    ram_start: int = 0  # resident memory when the stage began
    disk: int = 0  # work directory + pack after the stage
    weights: int | None = None


@dataclass
class Meter:
    """Wraps the stage functions `build` calls, to time each and record its peaks and the disk after it."""

    dirs: list[Path]
    stages: dict[str, StageRecord] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_start = torch.cuda.memory_allocated()
        _reset_ram_peak()
        ram_start = _ram_now()
        start = time.perf_counter()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            self.stages[name] = StageRecord(time.perf_counter() - start, torch.cuda.max_memory_allocated(), gpu_start,
                                            _ram_peak(), ram_start, sum(_du(d) for d in self.dirs))

    def wrap(self, name: str, fn):
        def metered(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)
        return metered


def _reset_ram_peak() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _ram_peak() -> int:
    return _status_bytes("VmHWM")


def _ram_now() -> int:
    return _status_bytes("VmRSS")


def _du(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def native_bytes(cfg: ModelConfig) -> int:
    """A native checkpoint's tensors (Engram tables and drafter included), as the layout states them: the
    real model's or a slice's."""
    return sum(s.nbytes for s in native_layout(cfg))


def write_slice(root: Path, raw: dict, seed: int) -> float:
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    backbone = native_bytes(cfg)
    start = time.perf_counter()
    write_native_checkpoint(root, raw, random_values(cfg, gen), max(2, math.ceil(backbone / SHARD_BYTES)))
    return time.perf_counter() - start


def _kind(unit) -> str:
    """What decides a unit's encode rate: its linear or batch (layer index dropped) and K."""
    parts = re.sub(r"\.K[\d.]+\.batch\d+$", "", unit.name).split(".")
    if parts[0] in ("layers", "mtp"):
        parts[1] = "L"
    return ".".join(parts) + f"@K{unit.K:g}"


def direct_rates(ck: Checkpoint, plan, work: Path, sample: int) -> dict[str, float]:
    """weights/s of quantize_exl3_batch on the first unit of every unit kind (see the module docstring)."""
    linears = {s.key: s for s in pack_spec(ck.config, plan).encoded}
    store = HessianStore(work, ck)
    reader = WeightReader(ck, "cuda")
    rates = {}
    for unit in work_units(list(linears.values()), "cuda"):
        kind = _kind(unit)
        if kind in rates or unit.K == 16:
            continue
        members = [linears[k] for k in unit.keys[:sample]]
        weights = [reader.weight(s) for s in members]
        if len(weights) == 1 and weights[0].numel() > HEAD_SAMPLE_WEIGHTS:
            weights = [weights[0][: max(256, HEAD_SAMPLE_WEIGHTS // weights[0].shape[1] // 256 * 256)]]
        hs = [store.hessian(s.key) for s in members]
        if any(h is None for h in hs):
            sys.exit(f"{unit.name}: no Hessian; the rehearsal compares calibrated units only (keep the drafter native)")
        shared = all(h is hs[0] for h in hs)
        hs = [(h.cuda(), c) for h, c in hs] if not shared else [(hs[0][0].cuda(), hs[0][1])]
        seconds = direct(weights, hs[0] if shared else hs, unit.K, torch.device("cuda", torch.cuda.current_device()))
        n = sum(w.numel() for w in weights)
        rates[kind] = n / seconds
        del weights
    return rates


def printed_estimates(ck: Checkpoint, plan, args, work: Path) -> dict[str, dict[str, float]]:
    """What `build` states before each stage, from the functions that print it, per stage."""
    settings = CalibrationSettings(device="cuda", measure_kl=False)
    calib = calibration_needs(ck.config, args.rows, args.cols, settings)
    linears = pack_spec(ck.config, plan).encoded
    by_key = {s.key: s for s in linears}
    units = work_units(linears, "cuda")
    ram = quantize_ram(units, by_key, PREFETCH_UNITS, "cuda", settings.expert_inputs, QuantizeSettings(device="cuda").encoder)
    gpu = quantize_gpu_memory(units, by_key, PREFETCH_UNITS, settings.expert_inputs)
    disk = quantize_disk(units, by_key, plan.codebook)
    return {
        "calibrate": {"GPU memory": calib.device, "RAM above start": calib.ram("cuda"), "disk kept": calib.layer_files},
        "quantize": {"RAM": ram, "GPU memory": gpu, "disk added": disk,
                     "seconds": plan_estimate(ck.config, plan).seconds},
        "pack": {"disk": disk_needs(ck, plan, 0, work).pack},
    }


def measured(stages: dict[str, StageRecord], pack_bytes: int) -> dict[str, dict[str, float]]:
    """The same quantities as printed_estimates, measured in this run."""
    c, q = stages["calibrate"], stages["quantize"]
    return {
        "calibrate": {"GPU memory": c.gpu_peak, "RAM above start": c.ram_peak - c.ram_start, "disk kept": c.disk},
        "quantize": {"RAM": q.ram_peak, "GPU memory": q.gpu_peak, "disk added": q.disk - stages["plan"].disk,
                     "seconds": q.seconds},
        "pack": {"disk": pack_bytes},
    }


def tune_settings(args) -> TuneSettings | None:
    return TuneSettings(steps=args.tune_steps) if args.tune else None


def tune_record(cfg: ModelConfig, result, record: StageRecord, args, work: Path) -> dict:
    """The tune stage on the slice (on the build's device, the GPU): its peak GPU memory above what it found
    allocated against tune_memory, and its seconds against what tune_seconds states for the steps each block
    ran (the blocks' own parts from the stage's records: block read, targets, codes, tuning, held-out)."""
    infos = [TunedStore(work).info(p) for p in result.files]
    settings = tune_settings(args)
    block_bytes = block_weight_bytes(cfg, DTYPE)
    stated = START_S + sum(block_seconds(block_bytes[b], args.rows, args.cols, replace(settings, steps=i["steps"]))
                           for b, i in zip(result.errors, infos))
    return {"seconds": record.seconds, "blocks": result.blocks, "tune_rows": result.tune_rows,
            "heldout_rows": result.heldout_rows, "steps": [i["steps"] for i in infos],
            "block_parts": [{k: i[k] for k in ("read_s", "targets_s", "codes_s", "seconds", "held_s")} for i in infos],
            "settings_steps": args.tune_steps, "cols": args.cols,
            "memory_estimate": tune_memory(cfg, args.rows, args.cols, settings),
            "memory_measured": record.gpu_peak - record.gpu_start, "seconds_estimate": stated}


def calibration_rate(ck: Checkpoint, rows: torch.Tensor, root: Path) -> dict[str, float]:
    """Seconds of calibration per layer: fixed (start-up, weights) and per token, from two runs on the
    slice at all and a quarter of the rows (the build's own calibration is the first)."""
    times = {}
    for n in (max(1, len(rows) // 4), len(rows)):
        start = time.perf_counter()
        calibrate(ck, rows[:n], root / f"rate-{n}", CalibrationSettings(device="cuda", measure_kl=False),
                  progress=False)
        torch.cuda.synchronize()
        times[n * rows.shape[1]] = time.perf_counter() - start
        shutil.rmtree(root / f"rate-{n}", ignore_errors=True)
    (t0, s0), (t1, s1) = sorted(times.items())
    per_token = (s1 - s0) / (t1 - t0)
    layers = ck.config.num_layers
    return {"fixed_s_per_layer": max(0.0, s0 - per_token * t0) / layers, "token_s_per_layer": per_token / layers,
            "runs": {str(t): v for t, v in times.items()}}


def full_layer_rate(path: Path | None) -> dict | None:
    """Seconds of one full-size layer at FULL_LAYER_ROWS rows, as bench/calibrate_gpu_layer.py projected them."""
    if path is None:
        return None
    try:
        report = json.loads(path.read_text())
        rate = {"seconds": float(report["projected_layer_seconds_at_250_rows"]), "cols": int(report["cols"]),
                "device": report["device"]}
        tiny = "tiny" in report["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"{path}: not a calibrate_gpu_layer.json ({type(e).__name__}: {e}); "
                 "write one with OUT=DIR python bench/calibrate_gpu_layer.py")
    if tiny:
        sys.exit(f"{path}: measured on tiny shapes; run bench/calibrate_gpu_layer.py at full size on this GPU")
    return rate


def unit_class(members: list) -> str:
    """Routed experts, or the rest: the real model's quantize time is nearly all routed experts, while a
    slice of few experts spends much of its time on the rest, small linears that run below the experts'
    rates the table holds."""
    return CLASSES[0] if members[0].target.group == ROUTED else CLASSES[1]


def stated_by_class(linears: list) -> dict[str, float]:
    """The seconds `build` states for these linears (the default encoder's rate table), per class."""
    table, stated = RateTable.load(), dict.fromkeys(CLASSES, 0.0)
    for s in linears:
        stated[unit_class([s])] += estimate([s], table).seconds
    return stated


def unit_times(linears: list, unit_seconds: dict[str, float]) -> list[dict]:
    """Each encoded unit of the slice: its class, linears, weights and K, what `build` stated for it and what
    the encoder took (the stage's unit_seconds, its wait for its inputs included): the data a per-unit
    price would be fitted to."""
    by_key, table = {s.key: s for s in linears}, RateTable.load()
    rows = []
    for u in work_units(linears, "cuda"):
        members = [by_key[k] for k in u.keys]
        rows.append({"unit": u.name, "class": unit_class(members), "linears": len(members), "weights": u.weights,
                     "K": u.K, "in_features": members[0].in_features, "stated_s": estimate(members, table).seconds,
                     "measured_s": unit_seconds[u.name]})
    return rows


def quantize_by_class(units: list[dict], stage_s: float) -> dict:
    """The slice's quantize stage per class, from its unit_times rows: what `build` stated and what the encoder
    took, and the stage's time outside any unit."""
    stated, measured = dict.fromkeys(CLASSES, 0.0), dict.fromkeys(CLASSES, 0.0)
    for row in units:
        stated[row["class"]] += row["stated_s"]
        measured[row["class"]] += row["measured_s"]
    return {"stated": stated, "measured": measured, "outside_units_s": stage_s - sum(measured.values())}


def real_quantize(linears: list, source_bytes: int, by_class: dict, slice_bytes: int) -> dict:
    """The real model's quantize stage on one GPU (`linears`: its plan's encoded linears; `source_bytes`: its
    native checkpoint's): per class of unit, the time `plan` states for it (the shipped encode rates,
    measured on full-size experts) times what the slice's encoder took over what `build` stated for that
    class, plus the slice's time outside any unit scaled by the sources' sizes (it reads the source's
    fingerprint: an upper bound). One ratio for the whole stage would let the slice's small linears, about
    half its weights against 1% of the real model's, set the experts' rate; pricing the real plan at the
    slice's own direct rates would price experts at a K the slice's plan did not give them."""
    stated = stated_by_class(linears)
    overall = sum(by_class["measured"].values()) / sum(by_class["stated"].values())
    ratios = {c: by_class["measured"][c] / by_class["stated"][c] if by_class["stated"][c] else overall
              for c in CLASSES}
    outside_s = by_class["outside_units_s"] * source_bytes / slice_bytes
    return {"seconds": sum(stated[c] * ratios[c] for c in CLASSES) + outside_s, "outside_units_s": outside_s,
            "by_class_s": {c: {"stated": stated[c], "projected": stated[c] * ratios[c]} for c in CLASSES}}


def real_needs(bpw: float, by_class: dict, run: dict) -> dict:
    """The real model at --bpw (uniform plan: the K mix an allocator starts from): its quantize time
    (real_quantize), calibration and pack scaled from this run, and the disk."""
    cfg = ModelConfig.from_file(model_config_path(REAL))
    plan = uniform_plan(cfg, bpw)
    quantize = real_quantize(pack_spec(cfg, plan).encoded, native_bytes(cfg), by_class, run["native_bytes"])
    quantize_s = quantize["seconds"]
    layer = run.get("full_layer")
    if layer:  # bench/calibrate_gpu_layer.py's measured rate on a full-size layer
        calibrate_s = cfg.num_layers * layer["seconds"] * (REAL_ROWS * REAL_COLS) / (FULL_LAYER_ROWS * layer["cols"])
    else:  # the slice's per-layer rate, all of it scaled by the experts: an upper bound (the small expert
        # matmuls of a slice run far below the GPU's rate, and the fixed part, which holds gate2's per-expert
        # Hessians, also holds the start-up; see the README)
        rate = run["calibration_rate"]
        calibrate_s = cfg.num_layers * (rate["fixed_s_per_layer"] + rate["token_s_per_layer"] * REAL_ROWS * REAL_COLS
                                        ) * cfg.n_routed_experts / run["experts"]
    pack_bytes = expected_bytes(cfg, plan)[TOTAL]
    tail_s = (run["stages"]["pack"]["seconds"] + run["stages"]["verify"]["seconds"]) * pack_bytes / run["pack_bytes"]
    needs = calibration_needs(cfg, REAL_ROWS, REAL_COLS, CalibrationSettings(device="cuda"))
    results = sum(exl3_bytes(s.in_features, s.out_features, s.K, plan.codebook) for s in pack_spec(cfg, plan).encoded
                  if s.K != 16)
    hours = {g: (calibrate_s / g + quantize_s / g + tail_s) / 3600 for g in GPU_COUNTS}
    tune = real_tune(cfg, run["tune"]) if "tune" in run else None
    return {
        "tune": tune,
        "plan": plan.made_by, "calibrate_h_1gpu": calibrate_s / 3600,
        "calibrate_from": ("full-size layer (bench/calibrate_gpu_layer.py)" if layer
                           else "slice, experts scaled (upper bound)"),
        "quantize_h_1gpu": quantize_s / 3600,
        "quantize_by_class_h": {c: {k: v / 3600 for k, v in parts.items()} for c, parts in quantize["by_class_s"].items()},
        "quantize_outside_units_h": quantize["outside_units_s"] / 3600,
        "pack_verify_h": tail_s / 3600, "hours_by_gpus": hours,
        "disk": {"hessians": needs.layer_files, "calibration_peak": needs.disk, "quantized_results": results,
                 "pack": pack_bytes},
    }


def real_tune(cfg: ModelConfig, measured: dict) -> dict:
    """The block-wise tune stage on the real model at the default settings and the real calibration's rows:
    its GPU memory (tune_memory) and hours (tune_seconds, every step paid), both checked on the slice above.
    It runs on rank 0's GPU while the other ranks wait, so on g GPUs it holds g times its hours."""
    settings = TuneSettings(steps=measured["settings_steps"])
    hours = tune_seconds(cfg, REAL_ROWS, REAL_COLS, settings) / 3600
    return {"memory_at_real_rows": tune_memory(cfg, REAL_ROWS, REAL_COLS, settings), "hours": hours,
            "rows_used": sum(settings.split(REAL_ROWS)), "gpu_hours_by_gpus": {g: hours * g for g in GPU_COUNTS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--bpw", type=float, default=2.9)
    ap.add_argument("--rows", type=int, default=16, help="calibration rows (random token ids)")
    ap.add_argument("--cols", type=int, default=2048, help="tokens per calibration row")
    ap.add_argument("--tune", action="store_true", help="build with --tune (block-wise) and meter its stage")
    ap.add_argument("--tune-steps", type=int, default=TuneSettings.steps, help="with --tune: Adam steps per block")
    ap.add_argument("--sample", type=int, default=16, help="experts per direct-call sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out-json", type=Path)
    ap.add_argument("--layer-rate", type=Path, help="calibrate_gpu_layer.json from bench/calibrate_gpu_layer.py on this "
                    "GPU: project calibration from its full-size layer instead of the slice")
    args = ap.parse_args()
    full_layer = full_layer_rate(args.layer_rate)  # before minutes of GPU work, so a bad file stops at once
    if not torch.cuda.is_available():
        sys.exit("rehearsal.py needs a CUDA GPU (and exllamav3)")
    root = Path(tempfile.mkdtemp(prefix="rehearsal-", dir=args.tmp))
    try:
        report = rehearse(args, root, full_layer)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_report(report)
    if args.out_json:
        args.out_json.write_text(json.dumps(report, indent=1) + "\n")


def rehearse(args, root: Path, full_layer: dict | None) -> dict:
    src, out = root / "src", root / "pack"
    raw = slice_config(args.layers, args.experts)
    meter = Meter([root / "pack.work", out])
    with meter.stage("write source"):
        write_slice(src, raw, args.seed)
    meter.stages["write source"].disk = _du(src)
    ck = Checkpoint.open(src)
    start = time.perf_counter()
    kernel.load(lambda line: print(f"rehearsal: {line}", file=sys.stderr))  # a first compile is not the stage's
    kernel_s = time.perf_counter() - start
    tokens = torch.randint(0, ck.config.vocab_size, (args.rows, args.cols),
                           generator=torch.Generator().manual_seed(args.seed))
    build_module = importlib.import_module("quantizer.orchestrate.stages")  # the module: the package exports build()
    originals = {}
    for fn, name in (("calibrate", "calibrate"), ("choose_plan", "plan"), ("quantize", "quantize"),
                     ("write_pack", "pack"), ("verify_pack", "verify"), ("tune", TUNE_STAGE)):
        originals[fn] = getattr(build_module, fn)
        setattr(build_module, fn, meter.wrap(name, originals[fn]))
    try:
        result = build(BuildRequest(str(src), out, bpw=args.bpw, calibration_rows=tokens, work=root / "pack.work",
                                    calibration_settings=CalibrationSettings(device="cuda", measure_kl=False),
                                    quantize=QuantizeSettings(device="cuda"), tune=tune_settings(args)))
    finally:
        for fn, original in originals.items():
            setattr(build_module, fn, original)
    linears = pack_spec(ck.config, result.plan).encoded
    encoded = [s for s in linears if s.K != 16]
    stages = meter.stages
    stages["quantize"].weights = sum(s.numel for s in encoded)
    stages["calibrate"].weights = args.rows * args.cols  # tokens
    pack_bytes = sum(r.bytes for r in result.manifest.shards)
    stages["pack"].weights = stages["verify"].weights = None

    rates = direct_rates(ck, result.plan, root / "pack.work", args.sample)
    units = work_units(linears, "cuda")
    direct_s = sum(u.weights / rates[_kind(u)] for u in units if u.K != 16)
    stage_s = stages["quantize"].seconds
    ratio = direct_s / stage_s
    units_timed = unit_times(linears, result.quantized.unit_seconds)
    by_class = quantize_by_class(units_timed, stage_s)
    run = {"layers": args.layers, "experts": args.experts, "tokens": args.rows * args.cols, "pack_bytes": pack_bytes,
           "native_bytes": native_bytes(ck.config),
           "stages": {k: vars(v) for k, v in stages.items()},
           "calibration_rate": calibration_rate(ck, tokens, root), "full_layer": full_layer}
    est, got = printed_estimates(ck, result.plan, args, root / "pack.work"), measured(stages, pack_bytes)
    if result.tuned is not None:
        run["tune"] = tune_record(ck.config, result.tuned, stages[TUNE_STAGE], args, root / "pack.work")
        est[TUNE_STAGE], got[TUNE_STAGE] = (
            {"GPU memory above its start": run["tune"]["memory_estimate"], "seconds": run["tune"]["seconds_estimate"]},
            {"GPU memory above its start": run["tune"]["memory_measured"], "seconds": run["tune"]["seconds"]})
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(), "source_bytes": _du(src), "kernel_load_s": kernel_s, **run,
        "plan": result.plan.made_by, "achieved_bpw": result.plan.achieved_bpw,
        "quantize": {"weights": stages["quantize"].weights, "stage_s": stage_s, "direct_s": direct_s,
                     "stage_weights_per_s": stages["quantize"].weights / stage_s,
                     "direct_weights_per_s": stages["quantize"].weights / direct_s, "ratio": ratio,
                     "direct_rates": {k: v for k, v in sorted(rates.items())}, "by_class": by_class,
                     "units": units_timed},
        "verify": "ok" if not result.verify.faults else f"{len(result.verify.faults)} faults",
        "estimates": [{"stage": st, "what": what, "estimate": est[st][what], "measured": got[st][what],
                       "ratio": est[st][what] / got[st][what] if got[st][what] else float("nan")}
                      for st in est for what in est[st]],
        "real_model": real_needs(args.bpw, by_class, run),
    }


def print_report(r: dict) -> None:
    print(f"\n{r['device']}: V4.1-Flash slice, {r['layers']} layers x {r['experts']} experts, "
          f"{r['source_bytes'] / GIB:,.2f} GiB native; {r['plan']} (achieved {r['achieved_bpw']:.3f}); verify {r['verify']}")
    rows = []
    for name in ("write source", *STAGES):
        s = r["stages"][name]
        rate = "" if not s["weights"] else f"{s['weights'] / s['seconds'] / 1e6:,.2f} M{'tok' if name == 'calibrate' else 'w'}/s"
        rows.append([name, f"{s['seconds']:,.1f}", rate, f"{s['gpu_peak'] / GIB:,.2f}", f"{s['ram_peak'] / GIB:,.2f}",
                     f"{s['disk'] / GIB:,.2f}"])
    print(table(["stage", "seconds", "rate", "GPU peak GiB", "RAM peak GiB", "disk GiB"], rows))
    print(f"our encoder kernel compiled or loaded before the build in {r['kernel_load_s']:,.1f} s (not in the "
          "quantize stage's seconds)")
    print("\nwhat build states before each stage, against what this run measured (goal: ratio 0.75-1.33)")
    rows = []
    for e in r["estimates"]:
        fmt = (lambda v: f"{v:,.1f} s") if e["what"] == "seconds" else (lambda v: f"{v / GIB:,.2f} GiB")
        ok = "ok" if 0.75 <= e["ratio"] <= 1.33 else "OFF"
        rows.append([e["stage"], e["what"], fmt(e["estimate"]), fmt(e["measured"]), f"{e['ratio']:.2f}", ok])
    print(table(["stage", "estimate of", "estimated", "measured", "ratio", ""], rows))
    rate = r["calibration_rate"]
    print(f"calibration per layer: {rate['fixed_s_per_layer']:,.2f} s fixed + {rate['token_s_per_layer'] * 1e6:,.3f} s "
          f"per million tokens (runs: {rate['runs']})")
    q = r["quantize"]
    print(f"\nquantize stage {q['stage_weights_per_s'] / 1e6:,.2f} M weights/s; quantize_exl3_batch on the same "
          f"tensors {q['direct_weights_per_s'] / 1e6:,.2f}: ratio {q['ratio']:.3f} "
          f"({'ok' if q['ratio'] >= 0.9 else 'BELOW 0.9'})")
    c = q["by_class"]
    print(table(["units", "stated s", "measured s", "ratio"],
                [[k, f"{c['stated'][k]:,.1f}", f"{c['measured'][k]:,.1f}",
                  f"{c['measured'][k] / c['stated'][k]:.2f}" if c["stated"][k] else "-"] for k in CLASSES]))
    print(f"outside any unit (start, fingerprint check, last save): {c['outside_units_s']:,.1f} s")
    m = r["real_model"]
    print(f"\nreal V4.1-Flash at {r['args']['bpw']:g} bpw ({m['plan']}), projected: calibration "
          f"{m['calibrate_h_1gpu']:,.2f} h (from the {m['calibrate_from']}), quantize {m['quantize_h_1gpu']:,.2f} h "
          f"on one GPU ("
          + ", ".join(f"{k} {v['projected']:,.2f} h against {v['stated']:,.2f} stated"
                      for k, v in m["quantize_by_class_h"].items())
          + f", outside units {m['quantize_outside_units_h']:,.2f} h), pack + verify {m['pack_verify_h']:,.2f} h")
    print(table(["GPUs", *map(str, GPU_COUNTS)], [["hours", *(f"{m['hours_by_gpus'][g]:,.2f}" for g in GPU_COUNTS)]]))
    if m["tune"]:
        t, got = m["tune"], r["tune"]
        parts = "; ".join(", ".join(f"{k} {v:,.1f}" for k, v in p.items()) for p in got["block_parts"])
        print(f"tune stage on the slice: {got['seconds']:,.1f} s; per block: {parts} "
              f"({', '.join(map(str, got['steps']))} steps; {got['tune_rows']} + {got['heldout_rows']} rows x {got['cols']})")
        print(f"real model, {t['rows_used']} of {REAL_ROWS} rows: GPU memory {t['memory_at_real_rows'] / GIB:,.1f} GiB, "
              f"at most {t['hours']:,.2f} h on rank 0's GPU; GPU-hours held: "
              + ", ".join(f"{g} GPU(s) {h:,.2f}" for g, h in t["gpu_hours_by_gpus"].items()))
    d = m["disk"]
    print(f"disk: Hessians {d['hessians'] / GIB:,.1f} GiB (calibration peak {d['calibration_peak'] / GIB:,.1f} GiB "
          f"with its resume point), quantized results {d['quantized_results'] / GIB:,.1f} GiB, pack "
          f"{d['pack'] / GIB:,.1f} GiB")


if __name__ == "__main__":
    main()
