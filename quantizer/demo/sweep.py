"""`quantizer demo`: a bundled small model (V4.1 by default, or V4) built at several sizes by four
methods, on the CPU, with the size, fit and quality of every pack.

Every pack is an ordinary `build` (orchestrate/stages.py) into one shared work directory, so every row
is exactly what `quantizer build` writes with the same settings (tests/test_demo.py checks one).
They share one calibration and the quantize stage's cache of encodings: each (tensor, K) any plan
needs is encoded once. Each size is anchored on exllamav3's own allocator (its plan's `bits`), and
uniform K and our allocator (once per loader profile asked for: exllamav3, vllm-exl3, tensorfold) get
the same budget, so the exllamav3 packs of one size compare at equal bytes; under vllm-exl3 that budget is
spent on the routed experts alone and the rest stays in the source's FP8 form (its engine's layout,
docs/loader-profiles.md), so its row holds more bytes (the bytes column says how many); under tensorfold
every linear is EXL3 and the Engram tables stay in the source's form in a directory beside the pack,
which the measurement reads as TensorFold does (ppl/measure.open_model). `--methods ...,ours-tuned`
adds our packs with `build --tune` (opt-in: docs/tuning.md), the same codes and bytes as ours. The
references are built first, for every size; our builds then allocate on the proxy errors the
references' encodings measured (what `build --measured-errors` reads from a work directory that holds
only those), so a rerun in the same work directory encodes nothing and plans the same. Each pack is verified, fitted and
compared with the native model on held-out text (KL, top-1 agreement, paired NLL delta): the shipped
`heldout` set, or `--eval-text` (another shipped set such as `heldout-tests`, text of another kind
than calibration, or a file); the builds do not depend on it, so a rerun in the same work directory
measures the same packs on another text.

Needs under 1 GiB of RAM, about 90 MB of disk in the work directory and about 5 minutes on 2 idle AVX2 cores
(17 M weights through the encoder's C++ kernel; several times that on the pure-torch fallback).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from quantizer.orchestrate.stages import QUANTIZE_DIR, BuildRequest, BuildResult, build
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.loader_profiles import LoaderProfile, all_profiles, stock_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import check_bpw
from quantizer.pack.fit_table import pack_fit_table
from quantizer.plan.allocate import AllocationSettings
from quantizer.plan.exl3_baseline import missing_for_baseline
from quantizer.pack.owned import engram_dir_of
from quantizer.ppl.compare import Comparison, compare
from quantizer.ppl.measure import open_model, streamer
from quantizer.ppl.perplexity import RowPredictions, row_predictions
from quantizer.quantize.linears import plan_units
from quantizer.quantize.results import measured_encodings
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import measured_proxies
from quantizer.shipped import shipped
from quantizer.textdata import model_rows, shipped_text_path, text_argument
from quantizer.tune.settings import TuneSettings

SIZES = (2.5, 2.9, 3.5)
UNIFORM, EXL3, OURS = "uniform", "exl3", "ours"
METHODS = (UNIFORM, EXL3, OURS)  # the default rows
TUNED = "ours-tuned"  # opt-in row: ours with `build --tune` (docs/tuning.md), same codes and bytes as ours
KNOWN_METHODS = METHODS + (TUNED,)
BUILD_DIR = "build"  # the shared build work directory: calibration and the encoding cache
def demo_loaders() -> tuple[str, ...]:
    """The profiles ours plans for in the demo: those whose JSON says `demo` (not exllamav3-v41: one Spark only)."""
    return tuple(p.name for p in all_profiles() if p.demo)


# The bundled trained models, by the name `--model` takes, and the package folder that holds each.
MODELS = {"small-v41": "small_model", "small-v4": "small_model_v4"}


@dataclass(frozen=True)
class DemoSettings:
    sizes: tuple[float, ...] = SIZES
    methods: tuple[str, ...] = METHODS
    loaders: tuple[str, ...] = field(default_factory=demo_loaders)  # ours once per profile; uniform, exl3 for stock
    model: str = "small-v41"
    calib_rows: int = 16
    eval_rows: int = 16
    eval_text: str = "heldout"  # what the packs are measured on: a shipped set's name or a file (text_argument)
    cols: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or not self.methods or not self.loaders:
            raise UserError("give at least one size, one method and one loader")
        for size in self.sizes:
            check_bpw(size, "mul1", "--sizes")
        unknown = [name for name in self.loaders if name not in demo_loaders()]
        if unknown:
            raise UserError(f"loader(s) {', '.join(unknown)} not in the demo; choose from {', '.join(demo_loaders())}")
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
    fits_1_spark: bool  # the pack's engine fits it on one Spark at the model's full context (fit.pack_fit_table)
    weights_gib: float | None  # resident weights on that Spark; None where the engine runs on more Sparks only


@dataclass(frozen=True)
class DemoResult:
    rows: list[DemoRow]
    native_ppl: float
    tokens: int
    seconds: float
    eval_text: str  # the text measured on, as asked for (DemoSettings.eval_text)


def run_demo(work: Path, settings: DemoSettings | None = None) -> DemoResult:
    start = time.monotonic()
    settings = settings or DemoSettings()
    stock, order = stock_profile(), {p.name: p.order for p in all_profiles()}
    eval_text = text_argument(settings.eval_text)  # a bad name fails here, before minutes of builds
    methods = _available(settings.methods)
    ck = Checkpoint.open(shipped(MODELS[settings.model]))
    cfg = ck.config

    def rows(text: Path, count: int) -> torch.Tensor:
        return model_rows(ck.root, cfg, text=text, rows=count, cols=settings.cols, default_cols=settings.cols)

    _say(f"demo: {ck.root.name}, sizes {', '.join(f'{s:g}' for s in settings.sizes)} bpw, methods "
         f"{', '.join(methods)}; work in {work}")
    calibration_rows = rows(shipped_text_path("calibration"), settings.calib_rows)
    built: dict[tuple[float, str, str], BuildResult] = {}

    def make(size: float, method: str, profile: LoaderProfile, bpw: float, measured=None) -> None:
        out = work / "packs" / f"{size:g}-{method}-{profile.name}"
        _say(f"demo: build {out.name} at {bpw:.4g} bpw")
        for old in (out, engram_dir_of(out)):  # a pack of an earlier demo run in this work directory
            shutil.rmtree(old, ignore_errors=True)
        built[size, method, profile.name] = build(BuildRequest(
            src=str(ck.root), out=out, bpw=bpw, method=OURS if method == TUNED else method,
            allocation=AllocationSettings(profile=profile), calibration_rows=calibration_rows,
            calibration_settings=CalibrationSettings(device="cpu"), work=work / BUILD_DIR,
            quantize=QuantizeSettings(seed=settings.seed, device="cpu", encoder="fast"), measured=measured,
            tune=TuneSettings() if method == TUNED else None))

    def budget(size: float) -> float:
        return built[size, EXL3, stock.name].plan.achieved_bpw if EXL3 in methods else size

    for size in settings.sizes:
        if EXL3 in methods:
            make(size, EXL3, stock, size)
        if UNIFORM in methods:
            make(size, UNIFORM, stock, budget(size))
    measured = _measured(cfg, work / BUILD_DIR, list(built.values()))
    profiles = [p for p in all_profiles() if p.name in settings.loaders and cfg.arch in p.archs]
    if len(profiles) < len(settings.loaders):
        _say(f"demo: {cfg.arch} runs in {', '.join(p.name for p in profiles)} only of the loaders asked for")
    for size in settings.sizes:
        for method in (m for m in (OURS, TUNED) if m in methods):
            for profile in profiles:
                make(size, method, profile, budget(size), measured)

    held = rows(eval_text, settings.eval_rows)
    _say(f"demo: measuring the native model and {len(built)} packs on {held.shape[0]} x {held.shape[1]} held-out "
         "tokens, one forward each; no time estimate (nothing under bench/ measures this step), the bar's rate "
         "follows the first pack")
    reference = list(row_predictions(streamer(ck, quiet=True), held))
    native_nll = torch.cat([r.nll() for r in reference])
    measured = measure_packs(reference, [result.out for result in built.values()], held)
    out = [_row(size, method, result.plan, result.manifest, result.out, c, not result.verify.faults)
           for ((size, method, _), result), c in zip(built.items(), measured)]
    rows_sorted = sorted(out, key=lambda r: (r.bpw, KNOWN_METHODS.index(r.method), order[r.loader]))
    return DemoResult(rows_sorted, float(native_nll.mean().exp()), native_nll.numel(), time.monotonic() - start,
                      settings.eval_text)


def measure_packs(reference: list[RowPredictions], packs: list[Path], held: torch.Tensor) -> list[Comparison]:
    """Each pack against the native model's predictions on the held-out rows, saying which pack of how many
    it is at, with a bar over the packs (a pack's forward is silent: minutes of them printed nothing)."""
    out = []
    with tqdm(total=len(packs), desc="measure", unit="pack", file=sys.stderr) as bar:
        for k, pack in enumerate(packs, 1):
            bar.write(f"demo: measuring pack {k} of {len(packs)}: {pack.name}", file=sys.stderr)
            out.append(compare(reference, row_predictions(streamer(open_model(pack), quiet=True), held)))
            bar.update()
    return out


def _measured(cfg, work: Path, references: list[BuildResult]) -> dict[str, dict[float, float]]:
    """The proxy errors the reference builds' own encodings measured (not whatever else the cache
    holds from an earlier run), so every run of the demo plans ours alike."""
    units = [u for r in references for u in plan_units(pack_spec(cfg, r.plan), r.plan.codebook, r.manifest.settings)]
    return measured_proxies(cfg, measured_encodings(work / QUANTIZE_DIR, units))


def _available(methods: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise UserError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(KNOWN_METHODS)}")
    if EXL3 in methods:
        if missing_for_baseline():
            _say("demo: exllamav3 is not installed (pip install 'quantizer[demo]'); skipping the exl3 baseline, "
                 "sizes anchored on the bpw asked for")
            return tuple(m for m in methods if m != EXL3)
    return methods


def _row(size: float, method: str, plan: Plan, manifest, pack: Path, c: Comparison, verified: bool) -> DemoRow:
    one = next(iter(pack_fit_table(pack)["topologies"].get("1", {}).values()), None)  # today's hardware profile
    return DemoRow(size, method, plan.profile.name, plan.achieved_bpw, sum(s.bytes for s in manifest.shards), c.pack.ppl, c.kl,
                   c.kl_stderr, c.top1, c.top1_stderr, c.nll_delta, c.nll_delta_stderr, verified,
                   bool(one and one["fits"]), one["weights_gib"][0] if one else None)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def as_json_rows(result: DemoResult) -> list[dict]:
    return [asdict(r) for r in result.rows]
