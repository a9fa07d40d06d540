"""The per-rank memory model: does a pack fit N Sparks at a context, and what would fit if not.

Per rank: visible memory (the head's; workers a little less) minus resident weights (placement.py),
the KV pool (replicated: one latent KV head cannot be split by heads), SWA rings per stream, the
prefill transient, engine runtime, the OS reserve and the guard floor (or the engine's own reserve
rule), and the Engram row cache when the tables stay on NVMe. `free` is what is left; a pack fits
when every rank's free is >= 0. Every term carries its source (configs/hardware/gb10.json).
"""

from __future__ import annotations

import json
import math
import dataclasses
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.rules import Findings
from quantizer.fit.decode import DecodeCost
from quantizer.errors import UserError
from quantizer.fit.hardware import GIB, Hardware, MappedServing, kv_bytes_per_token, load_hardware, swa_ring_bytes
from quantizer.fit.placement import DRAFTER_MODES, ENGRAM_MODES, SPLITS, VISION_MODES, Options, rank_weights
from quantizer.fit.residency import bytes_by_class, copy_rule, split_mapped
from quantizer.fit.stored import StoredTensor
from quantizer.model.targets import targets
from quantizer.model.tensor_classes import DRAFTER

TOPOLOGIES = (1, 2, 4)

# What a rank should keep free beyond the model's count: the terms are measured to within 25% (bench/), and
# a driver update or a second process on the Spark takes memory no term counts. A plan searched for the most
# bits keeps it; a fit that leaves less says so next to its verdict (`--margin` sets it, 0 turns it off).
MARGIN_GIB = 1.0

@dataclass
class RankMemory:
    rank: int
    visible_gib: float
    weights_gib: float
    kv_pool_gib: float
    swa_rings_gib: float
    prefill_gib: float
    runtime_gib: float
    os_gib: float
    guard_gib: float
    engram_cache_gib: float
    free_gib: float
    weights_by_class_gib: dict[str, float] = field(default_factory=dict)
    max_context: int = 0  # per stream, uncapped, on this rank alone
    mapped_gib: float = 0.0  # weights served from the mapped file (page cache), not in weights_gib
    mapped_by_class_gib: dict[str, float] = field(default_factory=dict)


@dataclass
class Explained:
    """One line of --explain: a term of the model, its value here, and its source."""

    name: str
    value: str
    source: str


@dataclass
class FitReport:
    source: str
    arch: str
    sparks: int
    engine: str
    split: str
    engram: str
    drafter: str
    vision: str
    context: int
    streams: int
    kv_bytes_per_token: float
    ranks: list[RankMemory]
    fits: bool
    short_gib: float  # how much the worst rank lacks (0 when it fits)
    worst_rank: int
    max_context: int  # largest per-stream context that fits every rank, capped at the model's positions
    max_context_capped: bool
    would_fit: dict  # smallest_sparks, max_context_here, highest_bpw (for --bpw inputs)
    verdict: str
    terms: list[Explained]
    mapped: bool = False  # the engine serves weights from the mapped file (RankMemory.mapped_gib)
    margin_gib: float = 0.0  # what the worst rank should keep free (MARGIN_GIB); less is said in the verdict
    loader: str = ""  # the loader profile whose engine's memory model this is
    findings: Findings | None = None  # the rules of that profile the layout breaks (sized all the same)
    decode: DecodeCost | None = None  # what a decode token costs in that engine (fit/decode.py), where known

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


@dataclass(frozen=True)
class FitOptions:
    """How the pack is placed on the target (the `fit` command's flags); the defaults are what the
    engines do out of the box."""

    split: str = "tp"
    engram: str = "nvme"
    drafter: str = "split"
    vision: str | None = None  # None: where the engine runs it (its TensorParallel.vision)
    guard_gib: float | None = None
    kv_bits: float | None = None
    copy_pattern: str | None = None  # an engine serving from the mapped file: what it copies (None: its default)
    fp8_lazy: bool = False  # such an engine keeps source-form FP8/FP4 linears compact (EXL3_FP8_LAZY=1)
    mmap_min: int | None = None  # such an engine's EXL3_ATS_MMAP_MIN, where a pack's launch.env sets it


@dataclass(frozen=True, kw_only=True)
class Scenario(FitOptions):
    """Everything but the weights: topology, engine, context and the placement options."""

    sparks: int
    context: int
    streams: int = 1
    engine: str

    def options(self, hw: Hardware) -> Options:
        tp = hw.engine(self.engine).tensor_parallel
        return Options(self.sparks, self.split, self.engram, self.drafter, self.vision or tp.vision, tp)


@dataclass(frozen=True)
class FitTarget:
    """What a pack must fit: Sparks, tokens per stream, streams and engine (None: the hardware file's
    default); `cold_share` is the routed tokens cold experts may take where the engine maps weights;
    `margin_gib` the free memory a rank keeps (the commands default to MARGIN_GIB)."""

    sparks: int
    context: int
    streams: int = 1
    engine: str | None = None
    cold_share: float = 0.0
    margin_gib: float = 0.0  # free memory every rank keeps: the search for the most bits leaves it

    def describe(self) -> str:
        return (f"{self.sparks} Spark{'s' if self.sparks > 1 else ''} at {self.context:,} tokens x {self.streams} "
                f"stream{'s' if self.streams > 1 else ''}")

    def scenario(self, hw: Hardware, drafter: bool = True) -> Scenario:
        s = Scenario(sparks=self.sparks, context=self.context, streams=self.streams,
                     engine=self.engine or hw.default_engine, drafter="split" if drafter else "off")
        check_topology(hw, s.engine, s.sparks)
        return s


def _check(s: Scenario, hw: Hardware) -> None:
    for value, allowed, flag in ((s.split, SPLITS, "--split"), (s.engram, ENGRAM_MODES, "--engram"),
                                 (s.drafter, DRAFTER_MODES, "--drafter"), (s.vision or "rank0", VISION_MODES, "--vision")):
        if value not in allowed:
            raise UserError(f"{flag} {value!r}; choose one of {', '.join(allowed)}")
    if s.sparks not in TOPOLOGIES:
        raise UserError(f"--sparks {s.sparks}; choose 1, 2 or 4")
    if s.context < 0 or s.streams < 1:
        raise UserError("--context must be >= 0 and --streams >= 1")
    check_topology(hw, s.engine, s.sparks)
    if s.copy_pattern is not None:
        copy_rule(s.copy_pattern)


def check_topology(hw: Hardware, engine_name: str, sparks: int) -> None:
    """UserError when the engine does not run on `sparks` Sparks."""
    engine = hw.engine(engine_name)
    if sparks not in engine.sparks:
        counts = " or ".join(str(n) for n in engine.sparks)
        raise UserError(f"engine {engine.name} runs on {counts} Spark(s) only ({engine.sparks_source}); "
                        f"pick another --engine for {sparks}")


def resident_and_mapped(stored: list[StoredTensor], s: Scenario, hw: Hardware
                        ) -> tuple[list[StoredTensor], dict[str, int]]:
    """(the tensors the engine holds in GPU memory, bytes it serves from the mapped file by class): all of
    them and none, unless the engine maps (residency.py). A drafter that is off is neither: the engine does not
    build it."""
    serving = mapped_serving(hw, s)
    if serving is None:
        return stored, {}
    copied, mapped = split_mapped(stored, serving, s.copy_pattern or serving.copy_default, s.fp8_lazy)
    if s.drafter == "off":
        mapped = [t for t in mapped if t.cls != DRAFTER]
    return copied, bytes_by_class(mapped)


def mapped_serving(hw: Hardware, s: Scenario) -> MappedServing | None:
    """The engine's mapping rules, with the floor a pack's launch.env sets (EXL3_ATS_MMAP_MIN)."""
    serving = hw.engine(s.engine).mapped
    return replace(serving, min_bytes=s.mmap_min) if serving and s.mmap_min else serving


def _rank_terms(
    cfg: ModelConfig, s: Scenario, hw: Hardware, weights: list[dict[str, int]], mapped: dict[str, int] | None = None
) -> tuple[list[RankMemory], float]:
    engine = hw.engine(s.engine)
    mapped = mapped or {}
    kvb = kv_bytes_per_token(cfg, engine, s.kv_bits, s.drafter != "off")
    per_token = s.streams * kvb + engine.prefill_bytes_per_context_token
    rings = s.streams * swa_ring_bytes(cfg, engine, s.drafter != "off") / GIB
    cache = 0.0
    if s.engram != "resident" and cfg.engram_layer_ids:
        row = cfg.engram_head_dim + cfg.engram_head_dim // 32
        cache = len(cfg.engram_layer_ids) * hw.engram_cache_rows_per_table.value * row / GIB
    ranks = []
    for r, by_class in enumerate(weights):
        visible = hw.visible(r)
        runtime = sum(t.gib for t in engine.runtime if r == 0 or not t.head_only)
        guard = engine.reserve_rule.gib(visible) if engine.reserve_rule else (
            hw.guard_gib.value if s.guard_gib is None else s.guard_gib)
        weights_gib = sum(by_class.values()) / GIB
        fixed = weights_gib + rings + engine.prefill_fixed_gib + runtime + hw.os_reserve_gib.value + guard + cache
        kv = s.streams * s.context * kvb / GIB
        prefill = engine.prefill_fixed_gib + s.context * engine.prefill_bytes_per_context_token / GIB
        base = visible - fixed
        ranks.append(RankMemory(
            rank=r, visible_gib=visible, weights_gib=weights_gib, kv_pool_gib=kv,
            swa_rings_gib=rings, prefill_gib=prefill, runtime_gib=runtime, os_gib=hw.os_reserve_gib.value,
            guard_gib=guard, engram_cache_gib=cache, free_gib=base - s.context * per_token / GIB,
            weights_by_class_gib={c: n / GIB for c, n in sorted(by_class.items())},
            max_context=_max_context(base, per_token, cfg),
            mapped_gib=sum(mapped.values()) / GIB, mapped_by_class_gib={c: n / GIB for c, n in mapped.items()},
        ))
    return ranks, kvb


def _max_context(base_gib: float, per_token: float, cfg: ModelConfig) -> int:
    """Tokens per stream that fit in what the fixed terms leave (0 if they alone overflow)."""
    if base_gib < 0:
        return 0
    return math.floor(base_gib * GIB / per_token) if per_token > 0 else cfg.max_position_embeddings


def evaluate(cfg: ModelConfig, stored: list[StoredTensor], s: Scenario, hw: Hardware) -> list[RankMemory]:
    """Per-rank memory of one scenario, without verdicts (the cheap inner step of searches)."""
    _check(s, hw)
    return _terms(cfg, stored, s, hw)[0]


def _terms(cfg: ModelConfig, stored: list[StoredTensor], s: Scenario, hw: Hardware) -> tuple[list[RankMemory], float]:
    resident, mapped = resident_and_mapped(stored, s, hw)
    return _rank_terms(cfg, s, hw, rank_weights(cfg, resident, s.options(hw)).by_class, mapped)


def _fits(ranks: list[RankMemory]) -> bool:
    return all(r.free_gib >= 0 for r in ranks)


BPW_FLOOR = 1.0  # fit's --bpw search starts here
FIT_TOLERANCE_BPW = 0.001
FIT_PROBES = 12


def fit(
    cfg: ModelConfig,
    stored: list[StoredTensor],
    target: FitTarget,
    options: FitOptions = FitOptions(),
    *,
    hardware: Hardware | None = None,
    source: str = "",
    stored_at_bpw: Callable[[float], list[StoredTensor]] | None = None,
    bpw: float | None = None,
    lowest_bpw: float = BPW_FLOOR,
    loader: str = "",
    findings: Findings | None = None,
) -> FitReport:
    """Fit `stored` on the target's Sparks, placed by `options`. When it does not fit, say by how much
    and what would: the smallest topology that fits, the context that fits here, and (given
    `stored_at_bpw`, a function that builds the pack at another bpw, from `lowest_bpw` up) the highest
    bpw that fits here."""
    hw = hardware or load_hardware()
    engine = target.engine or hw.default_engine
    s = Scenario(sparks=target.sparks, context=target.context, streams=target.streams, engine=engine,
                 **dataclasses.asdict(options))
    _check(s, hw)
    s = replace(s, vision=s.options(hw).vision)
    _check_context(cfg, target.context)
    ranks, kvb = _terms(cfg, stored, s, hw)
    fits = _fits(ranks)
    worst = min(ranks, key=lambda r: r.free_gib)
    raw_max = min(r.max_context for r in ranks)
    max_context = min(raw_max, cfg.max_position_embeddings)
    would: dict = {"max_context_here": max_context}
    if not fits:
        would["smallest_sparks"] = _smallest_topology(cfg, stored, s, hw)
        if stored_at_bpw is not None and bpw is not None:
            would["highest_bpw"] = _highest_bpw(cfg, s, hw, stored_at_bpw, lowest_bpw, bpw, target.margin_gib)
    report = FitReport(
        source=source, arch=cfg.arch, sparks=s.sparks, engine=s.engine, split=s.split, engram=s.engram,
        drafter=s.drafter, vision=s.vision, context=s.context, streams=s.streams, kv_bytes_per_token=kvb,
        ranks=ranks, fits=fits, short_gib=max(0.0, -worst.free_gib), worst_rank=worst.rank,
        max_context=max_context, max_context_capped=raw_max > cfg.max_position_embeddings,
        would_fit=would, verdict="", terms=explain_terms(cfg, s, hw), mapped=hw.engine(s.engine).mapped is not None,
        margin_gib=target.margin_gib, loader=loader, findings=findings,
    )
    report.verdict = verdict(report)
    return report


def _check_context(cfg: ModelConfig, context: int) -> None:
    if context > cfg.max_position_embeddings:
        raise UserError(f"--context {context:,} is beyond the model's {cfg.max_position_embeddings:,} positions; "
                        "use --streams for more tokens in flight")


def _smallest_topology(cfg, stored, s: Scenario, hw: Hardware) -> int | None:
    engine = hw.engine(s.engine)
    for n in TOPOLOGIES:
        if n <= s.sparks or n not in engine.sparks:
            continue
        if _fits(evaluate(cfg, stored, replace(s, sparks=n), hw)):
            return n
    return None


@dataclass(frozen=True)
class Boundary:
    """Where a search for the most bits that fit ended."""

    bpw: float  # the highest bpw found to fit, or the lowest accepted one when none fits
    free_gib: float  # the worst rank's free memory there; negative when nothing fits
    lowest: float  # the lowest bpw the pack builder accepted

    @property
    def fits(self) -> bool:
        return self.free_gib >= 0


def highest_fitting_bpw(cfg: ModelConfig, stored_at: Callable[[float], list[StoredTensor]], lo: float, hi: float,
                        s: Scenario, hw: Hardware,
                        scenario_at: Callable[[float], Scenario] | None = None, margin_gib: float = 0.0) -> Boundary:
    """The largest bpw in [lo, hi] (to FIT_TOLERANCE_BPW) whose pack `stored_at(bpw)` fits `s` with
    `margin_gib` left free on every rank (the Boundary's free memory is counted beyond the margin).

    The worst rank's free memory falls almost linearly with bpw, by about the budgeted weights'
    bytes per bpw over the ranks (tensor-parallel split), so Newton steps from the lowest rate,
    aimed just inside the root and corrected by the secant through the probes, end in two to four
    probes (a probe plans, lists the stored tensors and runs the memory model: ~2 s at full size).
    `stored_at` may raise UserError below its own lowest rate; `lo` is raised to the first bpw it
    accepts (UserError when none in [lo, hi] is). `scenario_at` gives the scenario of a probe where it
    depends on the plan (the drafter and cold experts of an engine that maps weights, target.py). A list
    `stored_at` returns again (the same pack at another bpw) is evaluated once."""
    seen: dict[int, tuple[list[StoredTensor], float]] = {}  # the list is kept so that its id is not reused

    def free(bpw: float) -> float:
        stored = stored_at(bpw)
        if id(stored) not in seen:
            report = evaluate(cfg, stored, scenario_at(bpw) if scenario_at else s, hw)
            seen[id(stored)] = stored, min(r.free_gib for r in report) - margin_gib
        return seen[id(stored)][1]

    lowest = lowest_accepted(stored_at, lo, hi)
    fit_bpw, fit_free = lowest, free(lowest)
    if fit_free < 0:
        return Boundary(lowest, fit_free, lowest)
    slope = sum(t.numel for t in targets(cfg) if t.budgeted) / (8 * s.sparks * GIB)  # GiB per bpw
    miss_bpw, miss_free = None, 0.0
    for _ in range(FIT_PROBES):
        upper = hi if miss_bpw is None else miss_bpw
        if fit_bpw >= hi or fit_free < slope * FIT_TOLERANCE_BPW or upper - fit_bpw <= FIT_TOLERANCE_BPW:
            break
        guess = fit_bpw + fit_free / slope - FIT_TOLERANCE_BPW / 2
        if not fit_bpw < guess < upper:
            guess = hi if miss_bpw is None else (fit_bpw + miss_bpw) / 2
        f = free(guess)
        if f >= 0:
            fit_bpw, fit_free = guess, f
        else:
            miss_bpw, miss_free = guess, f
        if miss_bpw is not None:
            slope = max((fit_free - miss_free) / (miss_bpw - fit_bpw), 1e-9)
    return Boundary(fit_bpw, fit_free, lowest)


def lowest_accepted(build_at: Callable[[float], object], lo: float, hi: float) -> float:
    """The lowest bpw in [lo, hi] (to FIT_TOLERANCE_BPW) that `build_at` accepts; build_at raises
    UserError below it (its floors alone exceed the budget)."""
    try:
        build_at(lo)
        return lo
    except UserError:
        pass
    try:
        build_at(hi)
    except UserError as e:
        raise UserError(f"no plan between {lo:.3f} and {hi:.3f} bpw: {e}") from None
    while hi - lo > FIT_TOLERANCE_BPW:
        mid = (lo + hi) / 2
        try:
            build_at(mid)
            hi = mid
        except UserError:
            lo = mid
    return hi


def _highest_bpw(cfg, s: Scenario, hw: Hardware, stored_at_bpw, lowest_bpw: float, bpw: float,
                 margin_gib: float) -> float | None:
    """The most bits that fit below `bpw` keeping the margin, rounded down to 0.01 so it can be typed
    (kept exact when that would fall below the lowest bpw a plan takes); None when not even the lowest fits."""
    try:
        b = highest_fitting_bpw(cfg, stored_at_bpw, lowest_bpw, bpw, s, hw, margin_gib=margin_gib)
    except UserError:
        return None
    if not b.fits:
        return None
    typed = math.floor(b.bpw * 100 + 1e-9) / 100
    return typed if typed >= b.lowest else b.bpw


def fit_table(
    cfg: ModelConfig,
    stored: list[StoredTensor],
    *,
    context: int,
    engine: str,
    streams: int = 1,
    split: str = "tp",
    engram: str = "nvme",
    drafter: str = "split",
    vision: str | None = None,
    copy_pattern: str | None = None,
    mmap_min: int | None = None,
    hardware: Hardware | None = None,
) -> dict:
    """Fit on each of 1, 2 and 4 Sparks that `engine` runs on (JSON-able, for the card and build): the
    engine that loads the pack only, never the design floor `native`, which runs no pack."""
    hw = hardware or load_hardware()
    _check_context(cfg, context)
    names = (engine,)
    table: dict = {"context": context, "streams": streams, "split": split, "engram": engram,
                   "drafter": drafter, "vision": vision or hw.engine(engine).tensor_parallel.vision, "hardware": hw.name,
                   "topologies": {}}
    for n in TOPOLOGIES:
        row = {}
        for name in names:
            if n not in hw.engine(name).sparks:
                continue
            s = Scenario(sparks=n, context=context, streams=streams, engine=name, split=split, engram=engram,
                         drafter=drafter, vision=vision, copy_pattern=copy_pattern, mmap_min=mmap_min)
            _check(s, hw)
            ranks, _ = _terms(cfg, stored, s, hw)
            row[name] = {
                "fits": _fits(ranks),
                "weights_gib": [round(r.weights_gib, 3) for r in ranks],
                "free_gib": [round(r.free_gib, 3) for r in ranks],
                "max_context": min(min(r.max_context for r in ranks), cfg.max_position_embeddings),
            }
            if hw.engine(name).mapped:
                row[name]["mapped_gib"] = [round(r.mapped_gib, 3) for r in ranks]
        if row:
            table["topologies"][str(n)] = row
    return table


def verdict(r: FitReport) -> str:
    where = f"{r.sparks} Spark{'s' if r.sparks > 1 else ''} ({r.engine}, {r.split})"
    ctx = f"{r.context:,} tokens x {r.streams} stream{'s' if r.streams > 1 else ''}"
    cap = " (the model's limit)" if r.max_context_capped else ""
    if r.fits:
        free = r.ranks[r.worst_rank].free_gib
        margin = (f" (less than the {r.margin_gib:g} GiB margin: memory the model does not count, a driver or a "
                  "second process, could tip it over; fewer bits or a shorter context keep the margin)"
                  if free < r.margin_gib else "")
        return (f"fits {where} at {ctx}; worst rank {r.worst_rank} keeps {free:.2f} GiB free{margin}; "
                f"largest context {r.max_context:,} tokens per stream{cap}{_page_cache(r)}")
    parts = [f"does not fit {where} at {ctx}: rank {r.worst_rank} is short by {r.short_gib:.2f} GiB"]
    if r.max_context > 0:
        parts.append(f"fits here at up to {r.max_context:,} tokens per stream")
    else:
        parts.append("does not fit here at any context")
    n = r.would_fit.get("smallest_sparks")
    if n:
        parts.append(f"fits {n} Sparks at this context")
    elif "smallest_sparks" in r.would_fit:
        parts.append(f"no larger topology with {r.engine} fits it at this context")
    if "highest_bpw" in r.would_fit:
        b = r.would_fit["highest_bpw"]
        sparks = f"{r.sparks} Spark{'s' if r.sparks > 1 else ''}"
        parts.append(f"--bpw {b:g} fits {sparks}" if b else "no bpw >= 1.0 fits here")
    return "; ".join(parts)


def _page_cache(r: FitReport) -> str:
    """For an engine that maps weights: how much of what it maps the memory left can keep in the page cache
    (the free memory and the guard: page cache is reclaimable); the rest is read from NVMe as it is used."""
    m = r.ranks[r.worst_rank]
    if not r.mapped or m.mapped_gib <= 0:
        return ""
    room = max(0.0, m.free_gib + m.guard_gib)
    kept = "all of it" if room >= m.mapped_gib else f"{room:.2f} GiB of it; the rest is read from NVMe as it is used"
    return f"; {m.mapped_gib:.2f} GiB served from the mapped file, the page cache can keep {kept}"


def explain_terms(cfg: ModelConfig, s: Scenario, hw: Hardware) -> list[Explained]:
    """Every number the model used, with its source."""
    e = hw.engine(s.engine)
    kvb = kv_bytes_per_token(cfg, e, s.kv_bits, s.drafter != "off")
    rings = swa_ring_bytes(cfg, e, s.drafter != "off")
    terms = [
        Explained("visible memory per Spark", f"{hw.visible_gib.value:g} GiB", hw.visible_gib.source),
        Explained("worker shortfall", f"{hw.worker_shortfall_gib.value:g} GiB on ranks 1..{s.sparks - 1}"
             if s.sparks > 1 else "n/a (one Spark)", hw.worker_shortfall_gib.source),
        Explained("OS reserve", f"{hw.os_reserve_gib.value:g} GiB", hw.os_reserve_gib.source),
    ]
    if e.reserve_rule:
        terms.append(Explained(f"{e.name} reserve (replaces the guard)",
                          f"max({e.reserve_rule.min_gib:g} GiB, {e.reserve_rule.fraction_of_visible:g} x visible)",
                          e.reserve_rule.source))
    else:
        g = hw.guard_gib.value if s.guard_gib is None else s.guard_gib
        terms.append(Explained("guard floor", f"{g:g} GiB", hw.guard_gib.source if s.guard_gib is None else "--guard"))
    terms += [Explained(f"{e.name}: {r.name}", f"{r.gib:g} GiB" + (" on rank 0" if r.head_only else ""), r.source)
              for r in e.runtime]
    terms += [
        Explained("KV + index keys per token per rank (replicated)", f"{kvb:,.1f} B" + _derived(e.kv_derive, s.kv_bits),
             e.kv_source + (f"; the drafter's cache layers: {e.drafter_kv_source}"
                            if e.drafter_kv_source and s.drafter != "off" else "")),
        Explained("SWA rings per stream", f"{rings:,.0f} B", f"{e.swa_rows_source}; {e.swa_row_source}"),
        Explained("prefill transient",
             f"{e.prefill_fixed_gib:g} GiB + {e.prefill_bytes_per_context_token:,.0f} B per context token",
             e.prefill_source),
        Explained("weights", f"split {s.split}, drafter {s.drafter}, vision {s.vision}",
             "docs/gb10-memory.md (tensor parallel); EXL3 splits on 128-wide blocks (jayleaton FOUR_SPARKS.md)"),
        Explained(f"{e.name}: tensor-parallel split", f"Engram wkv {e.tensor_parallel.engram_wkv}, embedding "
                  f"{e.tensor_parallel.embed}, four Sparks as {e.tensor_parallel.four_ranks}",
                  e.tensor_parallel.source or "the common rules (docs/gb10-memory.md)"),
    ]
    serving = mapped_serving(hw, s)
    if serving:
        copy = s.copy_pattern or serving.copy_default
        terms += [
            Explained("served from the mapped file", f"tensors of {serving.min_bytes:,} B or more on their grid, "
                      f"needing no conversion, whose name does not match EXL3_ATS_COPY='{copy}'; source-form linears "
                      + ("kept compact (EXL3_FP8_LAZY=1)" if s.fp8_lazy else "dequantized to FP16 (EXL3_FP8_LAZY off, "
                                                                               "the recipe's launch)"), serving.source),
            Explained("launcher floor", f"MemAvailable of at least {serving.launcher_floor_gib:g} GiB before the load "
                      f"(this Spark: {hw.visible_gib.value - hw.os_reserve_gib.value:g} GiB after the OS reserve)",
                      serving.source),
        ]
    if cfg.engram_layer_ids:
        src = {"nvme": hw.engram_cache_rows_per_table.source, "scales": hw.engram_scales_source,
               "resident": "tables resident, split across ranks by hash heads (jayleaton FOUR_SPARKS.md)"}[s.engram]
        terms.append(Explained("Engram tables", s.engram, src))
    return terms


def _derived(fmt: str | None, kv_bits: float | None) -> str:
    if fmt is None:
        return ""
    return f" (derived, {fmt}" + (f", k_bits {kv_bits:g})" if kv_bits else ")")
