"""`quantizer demo`: a bundled small model (V4.1 by default, or V4) built at several sizes by four
methods, on the CPU, with the size, fit and quality of every pack.

One calibration serves every pack. Each size is anchored on exllamav3's own allocator (its plan's
`bits`), and uniform K and our allocator (once per loader profile asked for: exllamav3, mixedk)
get the same budget, so the
packs of one size compare at equal bytes. Every (tensor, K) any plan needs is encoded once and the
packs share those encodings: first the references' pairs, whose measured proxy errors then feed
our sensitivity, then whatever our plans add. Each pack is written, verified, fitted and compared
with the native model on held-out text (KL, top-1 agreement, paired NLL delta).

Needs under 1 GiB of RAM, about 90 MB of disk in the work directory and about 9 minutes on 2 AVX2 cores
(16 M weights through the encoder's C++ kernel; several times that on the pure-torch fallback).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.stage import calibrate
from quantizer.calibrate.storage import HessianStore
from quantizer.checkpoint.safetensors_file import read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.exl3 import check_bpw
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.model.targets import targets
from quantizer.pack.writer import PackSettings, write_pack
from quantizer.plan.allocate import AllocationSettings, allocate
from quantizer.plan.exl3_baseline import exl3_plan
from quantizer.plan.plan import Plan, make_plan
from quantizer.plan.profiles import EXLLAMAV3, LOADERS, MIXEDK
from quantizer.plan.sensitivity import sensitivity
from quantizer.plan.uniform import uniform_plan
from quantizer.ppl.compare import Comparison, compare
from quantizer.ppl.pack_source import PackSource
from quantizer.ppl.perplexity import row_predictions
from quantizer.quantize.linears import stored_linears
from quantizer.quantize.results import RESULTS_DIR, SUFFIX
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import quantize
from quantizer.shipped import shipped
from quantizer.textdata import model_rows, shipped_text_path
from quantizer.verify.verify import verify_pack

SIZES = (2.5, 2.9, 3.5)
UNIFORM, EXL3, OURS = "uniform", "exl3", "ours"
METHODS = (UNIFORM, EXL3, OURS)
# The bundled trained models, by the name `--model` takes, and the package folder that holds each.
MODELS = {"small-v41": "small_model", "small-v4": "small_model_v4"}


@dataclass(frozen=True)
class DemoSettings:
    sizes: tuple[float, ...] = SIZES
    methods: tuple[str, ...] = METHODS
    loaders: tuple[str, ...] = LOADERS  # ours is planned once per profile; uniform and exl3 plans load in all
    model: str = "small-v41"
    calib_rows: int = 16
    eval_rows: int = 16
    cols: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or not self.methods or not self.loaders:
            raise UserError("give at least one size, one method and one loader")
        for size in self.sizes:
            check_bpw(size, "mul1", "--sizes")
        unknown = [name for name in self.loaders if name not in LOADERS]
        if unknown:
            raise UserError(f"unknown loader(s) {', '.join(unknown)}; choose from {', '.join(LOADERS)}")
        if self.model not in MODELS:
            raise UserError(f"unknown --model {self.model!r}; choose from {', '.join(MODELS)}")
        if min(self.calib_rows, self.eval_rows) < 1 or self.cols < 2:
            raise UserError(f"--eval-rows {self.eval_rows}: rows must be at least 1 (and columns 2)")


@dataclass(frozen=True)
class DemoRow:
    bpw: float  # the size asked for
    method: str
    loader: str  # the loader profile the pack is made for (and verified against)
    achieved_bpw: float  # exllamav3's `bits` accounting of the plan (budgeted tensors)
    bytes: int  # the pack's shards
    ppl: float
    kl: float
    kl_stderr: float
    top1: float
    top1_stderr: float
    nll_delta: float
    nll_delta_stderr: float
    verified: bool
    fits_1_spark: bool  # every engine's fit on one Spark at the model's full context (manifest fit table)
    weights_gib: float  # resident weights on that Spark


@dataclass(frozen=True)
class DemoResult:
    rows: list[DemoRow]
    native_ppl: float
    tokens: int
    seconds: float


def run_demo(work: Path, settings: DemoSettings = DemoSettings()) -> DemoResult:
    start = time.monotonic()
    methods = _available(settings.methods)
    ck = Checkpoint.open(shipped(MODELS[settings.model]))
    cfg = ck.config

    def rows(name: str, count: int) -> torch.Tensor:
        return model_rows(ck.root, cfg, text=shipped_text_path(name), rows=count, cols=settings.cols,
                          default_cols=settings.cols)

    _say(f"demo: {ck.root.name}, sizes {', '.join(f'{s:g}' for s in settings.sizes)} bpw, methods "
         f"{', '.join(methods)}; work in {work}")
    calibrated = calibrate(ck, rows("calibration", settings.calib_rows), work, CalibrationSettings(device="cpu"))
    store = HessianStore(work, ck)
    encoder = Encoder(ck, work / "encodings", store, settings.seed)

    plans: dict[tuple[float, str, str], Plan] = {}
    for size in settings.sizes:
        if EXL3 in methods:
            plans[size, EXL3, EXLLAMAV3] = exl3_plan(cfg, size)
        budget = plans[size, EXL3, EXLLAMAV3].achieved_bpw if EXL3 in methods else size
        if UNIFORM in methods:
            plans[size, UNIFORM, EXLLAMAV3] = uniform_plan(cfg, budget)
    encoder.encode([p for p in plans.values()])  # the references' pairs: their proxy errors are measured
    sens = sensitivity(cfg, calibrated.summary, measured=encoder.measured_proxies())
    for size in settings.sizes:
        budget = plans[size, EXL3, EXLLAMAV3].achieved_bpw if EXL3 in methods else size
        if OURS in methods:
            for loader in settings.loaders:
                plans[size, OURS, loader] = allocate(cfg, sens, budget, AllocationSettings(loader=loader))
    encoder.encode(list(plans.values()))

    held = rows("heldout", settings.eval_rows)
    reference = list(row_predictions(_streamer(CheckpointSource(ck)), held))
    native_nll = torch.cat([r.nll() for r in reference])
    out = []
    for (size, method, loader), plan in plans.items():
        pack = work / "packs" / f"{size:g}-{method}-{loader}"
        _say(f"demo: pack {pack.name} ({plan.achieved_bpw:.3f} bpw)")
        manifest = _pack(ck, plan, encoder, work / "pack-work" / pack.name, pack)
        report = verify_pack(pack)
        c = compare(reference, row_predictions(_streamer(PackSource(Checkpoint.open(pack))), held))
        out.append(_row(size, method, plan, manifest, c, not report.faults))
    rows_sorted = sorted(out, key=lambda r: (r.bpw, METHODS.index(r.method), LOADERS.index(r.loader)))
    return DemoResult(rows_sorted, float(native_nll.mean().exp()), native_nll.numel(), time.monotonic() - start)


def _available(methods: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if EXL3 in methods:
        if not all(importlib.util.find_spec(m) for m in ("exllamav3", "triton")):
            _say("demo: exllamav3 is not installed (pip install 'quantizer[dev]'); skipping the exl3 baseline, "
                 "sizes anchored on the bpw asked for")
            return tuple(m for m in methods if m != EXL3)
    return methods


class Encoder:
    """Every (stored linear, K) encoded once, in a work directory per K; packs link the files they need."""

    def __init__(self, ck: Checkpoint, root: Path, store: HessianStore, seed: int):
        self.ck, self.root, self.store = ck, root, store
        self.settings = QuantizeSettings(seed=seed, device="cpu", encoder="fast", calibration=store.record)

    def encode(self, plans: list[Plan]) -> None:
        """Encode the pairs these plans need that no earlier call encoded."""
        needed: dict[float, set[str]] = defaultdict(set)
        codebook = plans[0].codebook
        for plan in plans:
            for s in stored_linears(self.ck.config, plan):
                if self.file(s.key, s.K) is None:
                    needed[s.K].add(s.target.key)
        for k in sorted(needed):
            keys = needed[k]
            plan = make_plan(self.ck.config, {t: (k if t in keys else None) for t in plans[0].k}, codebook, MIXEDK,
                             made_by="demo: one K of the shared encodings")
            quantize(self.ck, plan, self._dir(k, keys), self.settings, self.store.hessian)

    def _dir(self, k: float, keys: set[str]) -> Path:
        """One directory per (K, key set): a rerun after a kill finds its own job again, and a later
        batch of the same K (other keys) gets a directory of its own."""
        digest = hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:10]
        return self.root / f"K{k:g}-{digest}"

    def file(self, stored_key: str, k: float) -> Path | None:
        for d in sorted(self.root.glob(f"K{k:g}-*")):
            path = d / RESULTS_DIR / (stored_key + SUFFIX)
            if path.exists():
                return path
        return None

    def measured_proxies(self) -> dict[str, dict[float, float]]:
        """Measured proxy error per target key and K (a wo_a's slices averaged)."""
        per: dict[tuple[str, float], list[float]] = defaultdict(list)
        for path in self.root.glob(f"K*-*/{RESULTS_DIR}/*{SUFFIX}"):
            meta = read_header(path).metadata
            k = float(meta["K"])
            for key, err in json.loads(meta["proxy_err"]).items():
                if err is not None:
                    per[key.split(".slice.")[0], k].append(err)
        budgeted = {t.key for t in targets(self.ck.config) if t.budgeted}
        out: dict[str, dict[float, float]] = defaultdict(dict)
        for (key, k), errs in per.items():
            if key in budgeted:
                out[key][k] = sum(errs) / len(errs)
        return dict(out)


def _pack(ck: Checkpoint, plan: Plan, encoder: Encoder, pack_work: Path, out: Path):
    """A pack from the shared encodings: the plan's unit files hard-linked into a work dir of its own."""
    shutil.rmtree(pack_work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    results = pack_work / RESULTS_DIR
    results.mkdir(parents=True)
    for s in stored_linears(ck.config, plan):
        src = encoder.file(s.key, s.K)
        if src is None:
            raise RuntimeError(f"demo: {s.key} at K{s.K:g} was never encoded")
        os.link(src, results / src.name)
    return write_pack(ck, plan, pack_work, out, PackSettings(job_settings=encoder.settings.record()))


def _streamer(source) -> LayerStreamer:
    return LayerStreamer(source, progress=False, report=lambda line: None)


def _row(size: float, method: str, plan: Plan, manifest, c: Comparison, verified: bool) -> DemoRow:
    one = manifest.fit["topologies"]["1"]
    weights = next(iter(one.values()))["weights_gib"][0]
    return DemoRow(size, method, plan.loader, plan.achieved_bpw, sum(s.bytes for s in manifest.shards), c.pack.ppl, c.kl,
                   c.kl_stderr, c.top1, c.top1_stderr, c.nll_delta, c.nll_delta_stderr, verified,
                   all(v["fits"] for v in one.values()), weights)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def as_json_rows(result: DemoResult) -> list[dict]:
    return [asdict(r) for r in result.rows]
