"""The GB10 hardware profile (configs/hardware/gb10.json) as typed terms, each with its source,
and the per-token KV and SWA-ring bytes an engine profile implies for a given model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantizer.checkpoint.config import V4, ModelConfig
from quantizer.errors import UserError
from quantizer.shipped import shipped

GIB = 1 << 30
DESIGN_FLOOR = "native"  # the engine entry of configs/hardware that is DeepSeek's design floor: a lower bound, runs no pack


@dataclass(frozen=True)
class Term:
    """One number of the memory model and where it comes from."""

    value: float
    source: str


@dataclass(frozen=True)
class RuntimeTerm:
    name: str
    gib: float
    source: str
    head_only: bool = False  # held on rank 0 only (the API server and what the head runs besides)


@dataclass(frozen=True)
class ReserveRule:
    """An engine's own headroom: max(min_gib, fraction x visible); replaces the guard floor."""

    min_gib: float
    fraction_of_visible: float
    source: str

    def gib(self, visible_gib: float) -> float:
        return max(self.min_gib, self.fraction_of_visible * visible_gib)


@dataclass(frozen=True)
class MappedServing:
    """An engine that serves large, aligned, unconverted tensors from the mapped file (page cache)
    instead of copying them into GPU memory, unless their name matches its copy pattern (fit/residency.py)."""

    min_bytes: int  # smaller tensors are copied
    trellis_align: int  # an int16 (trellis) tensor's file offset must be a multiple of this; others: their item size
    copy_default: str  # the copy pattern (a regex on tensor names) the engine's recipe launches with
    loads_vision: bool  # whether the engine builds a vision tower at all
    launcher_floor_gib: float  # MemAvailable the launcher wants before it starts
    source: str
    chunk: int = 0  # the prefill chunk (CHUNK) the engine's prefill term is priced at
    as_stored: tuple[str, ...] = ()  # name patterns of BF16 / F32 tensors the loader reads without converting them


REPLICATED, SPLIT = "replicated", "split"
TP, PAIRS = "tp", "pairs"


@dataclass(frozen=True)
class TensorParallel:
    """What an engine's tensor-parallel split does beyond the common rules (fit/placement.py), from its code:
    Engram's wkv and the embedding split or replicated, four Sparks as one TP4 group or as two TP2 pairs
    (experts balanced across the four, the drafter split inside each pair), and where the vision encoder runs
    by default."""

    engram_wkv: str = SPLIT
    embed: str = SPLIT
    four_ranks: str = TP
    vision: str = "rank0"
    source: str = ""


@dataclass(frozen=True)
class Engine:
    name: str
    description: str
    sparks: tuple[int, ...]  # the Spark counts (ranks) the engine runs on
    sparks_source: str
    kv_bytes_per_token: Term | None  # measured; None when derived from the architecture
    kv_derive: str | None  # "native" | "fp16"
    kv_source: str
    swa_ring_rows: int | str  # rows per layer per stream, or "window"
    swa_rows_source: str
    swa_row: str  # "native" | "fp16"
    swa_row_source: str
    runtime: tuple[RuntimeTerm, ...]
    prefill_fixed_gib: float
    prefill_bytes_per_context_token: float
    prefill_source: str
    reserve_rule: ReserveRule | None
    drafter_kv_source: str | None = None  # the drafter's own cache layers (one fp16 row per block per token)
    mapped: MappedServing | None = None
    tensor_parallel: TensorParallel = TensorParallel()


@dataclass(frozen=True)
class Decoding:
    """The constants of the decode model (fit/decode.py): memory bandwidth, the cost of a kernel launch issued
    eagerly and inside a CUDA graph, and of one tensor-parallel all-reduce; fitted to published measurements."""

    bandwidth_gbps: float
    eager_launch_us: float
    graph_launch_us: float
    allreduce_us: float
    verify_row_cost: float  # a verify round's time per drafted row, in tokens' time
    draft_acceptance: float  # the chance a draft is accepted after the one before it was
    source: str


@dataclass(frozen=True)
class Hardware:
    name: str
    visible_gib: Term
    worker_shortfall_gib: Term
    os_reserve_gib: Term
    guard_gib: Term
    engram_cache_rows_per_table: Term
    engram_scales_source: str
    default_engine: str
    engines: dict[str, Engine]
    decode: Decoding | None = None

    def engine(self, name: str) -> Engine:
        if name not in self.engines:
            raise UserError(f"unknown engine {name!r}; {self.name} profiles: {', '.join(self.engines)}")
        return self.engines[name]

    def visible(self, rank: int) -> float:
        return self.visible_gib.value - (self.worker_shortfall_gib.value if rank else 0.0)


def load_hardware(path: str | Path | None = None) -> Hardware:
    """The shipped GB10 profile, or a profile file of the same shape."""
    path = Path(path) if path else shipped("configs", "hardware", "gb10.json")
    try:
        data = json.loads(path.read_text())
        return Hardware(
            name=data["name"],
            visible_gib=_term(data["visible_gib"]),
            worker_shortfall_gib=_term(data["worker_shortfall_gib"]),
            os_reserve_gib=_term(data["os_reserve_gib"]),
            guard_gib=_term(data["guard_gib"]),
            engram_cache_rows_per_table=_term(data["engram_cache_rows_per_table"]),
            engram_scales_source=data["engram_scales_mode"]["source"],
            default_engine=data["default_engine"]["value"],
            engines={name: _engine(name, e) for name, e in data["engines"].items()},
            decode=Decoding(**data["decode"]),
        )
    except FileNotFoundError:
        raise UserError(f"{path}: hardware profile not found")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: malformed hardware profile ({type(e).__name__}: {e})")


def _term(d: dict) -> Term:
    return Term(float(d["value"]), str(d["source"]))


def _engine(name: str, e: dict) -> Engine:
    kv = e["kv_bytes_per_token"]
    rule = e.get("reserve_rule")
    reserve = ReserveRule(float(rule["min_gib"]), float(rule["fraction_of_visible"]), rule["source"]) if rule else None
    rows = e["swa_ring_rows"]["value"]
    drafter_kv = e.get("drafter_kv_bytes_per_token")
    mapped = e.get("mapped")
    tp = e.get("tensor_parallel")
    return Engine(
        name=name,
        description=e["description"],
        sparks=tuple(int(n) for n in e["sparks"]["value"]),
        sparks_source=str(e["sparks"]["source"]),
        kv_bytes_per_token=_term(kv) if "value" in kv else None,
        kv_derive=kv.get("derive"),
        kv_source=kv["source"],
        swa_ring_rows=rows if rows == "window" else int(rows),
        swa_rows_source=e["swa_ring_rows"]["source"],
        swa_row=e["swa_row"]["derive"],
        swa_row_source=e["swa_row"]["source"],
        runtime=tuple(RuntimeTerm(r["name"], float(r["gib"]), r["source"], bool(r.get("head_only", False)))
                      for r in e["runtime"]),
        prefill_fixed_gib=float(e["prefill"]["fixed_gib"]),
        prefill_bytes_per_context_token=float(e["prefill"]["bytes_per_context_token"]),
        prefill_source=e["prefill"]["source"],
        reserve_rule=reserve,
        drafter_kv_source=drafter_kv["source"] if drafter_kv else None,
        mapped=MappedServing(int(mapped["min_bytes"]), int(mapped["trellis_align"]), str(mapped["copy_default"]),
                             bool(mapped["loads_vision"]), float(mapped["launcher_floor_gib"]),
                             str(mapped["source"]), int(mapped["chunk"]), tuple(mapped["as_stored"])) if mapped else None,
        tensor_parallel=_tensor_parallel(tp) if tp else TensorParallel(),
    )


def _tensor_parallel(d: dict) -> TensorParallel:
    tp = TensorParallel(d["engram_wkv"], d["embed"], d["four_ranks"], d["vision"], d["source"])
    if tp.engram_wkv not in (SPLIT, REPLICATED) or tp.embed not in (SPLIT, REPLICATED) or tp.four_ranks not in (TP, PAIRS):
        raise ValueError(f"tensor_parallel: engram_wkv and embed split|replicated, four_ranks tp|pairs; got {d}")
    return tp


# ---- per-token state bytes derived from the architecture -------------------------------------

def _entries_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(compressed KV entries, index keys) written per token: one per kv-source layer per `ratio`
    tokens (V4.1: sources 2, 8, 14 at ratio 2 and 20 at ratio 1 = 2.5)."""
    kv = idx = 0.0
    for layer in range(cfg.num_layers):
        r = cfg.ratio(layer)
        if r and cfg.is_kv_source(layer):
            kv += 1 / r
            if cfg.owns_index_keys(layer):
                idx += 1 / r
    return kv, idx


def kv_entry_bytes(cfg: ModelConfig, fmt: str, kv_bits: float | None = None) -> tuple[float, float]:
    """(bytes of one compressed KV entry, bytes of one index key) in a cache format."""
    hd, rope, ihd = cfg.head_dim, cfg.rope_dim, cfg.index_head_dim
    if fmt == "native" and cfg.arch == V4:
        # V4 fp8_ds_mla entry: 448 E4M3 nope + 64 BF16 RoPE + 7 scale bytes + 1 pad = 584
        entry = (hd - rope) + 2 * rope + (hd - rope) // 64 + 1
        return entry, ihd / 2 + ihd / 32
    if fmt == "native":
        # V4.1: 512 E2M1 (RoPE included) + one E4M3 scale per 16 = 288; index key 128 FP4 + 4 UE8M0 = 68
        return hd / 2 + hd / 16, ihd / 2 + ihd / 32
    if fmt == "fp16" and kv_bits is None:
        return 2 * hd, 2 * ihd
    if fmt == "fp16":
        nope = hd - rope
        return nope * kv_bits / 8 + 2 * rope + 2 * nope / 32, 2 * ihd
    raise UserError(f"unknown KV format {fmt!r} in the hardware profile")


def derived_kv_bytes_per_token(cfg: ModelConfig, fmt: str, kv_bits: float | None = None) -> float:
    kv, idx = _entries_per_token(cfg)
    entry, key = kv_entry_bytes(cfg, fmt, kv_bits)
    return kv * entry + idx * key


def kv_bytes_per_token(cfg: ModelConfig, engine: Engine, kv_bits: float | None = None, drafter_on: bool = True) -> float:
    """KV and index-key bytes per token per rank (replicated on every rank: one latent KV head), with the
    drafter's own cache layers where the engine keeps them and the drafter is on."""
    if kv_bits is not None and engine.kv_derive != "fp16":
        raise UserError(f"--kv-bits applies to engines with fp16 DSA pools (exllamav3), not {engine.name}")
    drafter = cfg.num_mtp_blocks * swa_row_bytes(cfg, "fp16") if engine.drafter_kv_source and drafter_on else 0.0
    if engine.kv_bytes_per_token is not None:
        return engine.kv_bytes_per_token.value + drafter
    return derived_kv_bytes_per_token(cfg, engine.kv_derive, kv_bits) + drafter


def swa_row_bytes(cfg: ModelConfig, fmt: str) -> float:
    """One sliding-window row: V4.1 FP8 + one UE8M0 per 32 (528 B), V4 its 584 B entry, or fp16."""
    hd = cfg.head_dim
    if fmt == "fp16":
        return 2 * hd
    return kv_entry_bytes(cfg, "native")[0] if cfg.arch == V4 else hd + hd // 32


def swa_ring_bytes(cfg: ModelConfig, engine: Engine, drafter_on: bool) -> float:
    """SWA ring bytes per stream: every trunk layer (and drafter block) keeps a bounded ring."""
    rows = cfg.sliding_window if engine.swa_ring_rows == "window" else engine.swa_ring_rows
    rings = cfg.num_layers + (cfg.num_mtp_blocks if drafter_on else 0)
    return rings * rows * swa_row_bytes(cfg, engine.swa_row)
