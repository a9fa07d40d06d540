"""What a decode token costs in its engine on GB10, as a model (docs/decode-speed.md): the bytes each rank reads, the
kernel launches by the dispatch path each layer's routed-expert K layout takes in that engine, and a rate.

Bytes: every resident tensor a token runs through (the dequantized FP16 copy where the engine makes one), the
routed experts by the chance a token (or a verify round of R rows) selects them (the calibration's routing, or
uniform), the KV entries and index keys attention reads at the context, and, with the drafter, its own weights
and the head once more per round. Launches: the engine's launches per layer and per token outside the MoE, and for
each layer those of the path its expert layout reaches (the profile's `decode` section, read from the engine's
code): the fused kernel where every expert of the layer shares the K tuple the fused path takes, else the
engine's mixed-K path (per active expert, per group or one kernel), eager or inside CUDA graphs. Time per token:
the worst rank's bytes over the bandwidth, plus each launch's cost in its mode and the tensor-parallel all-reduces
(configs/hardware/gb10.json `decode`, fitted to published measurements with one held out; bench/decode_model.py).
With the drafter a round verifies `draft + 1` rows, which costs a token's time times 1 + verify_row_cost x draft (as
measured: a 4-row window ~1.6x one row), plus the drafter's own pass, and yields the accepted drafts plus one
token, each draft accepted with draft_acceptance after the one before it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import ALL_PROJECTIONS, LoaderProfile
from quantizer.contract.plan import Plan
from quantizer.fit.hardware import GIB, Decoding, Hardware, kv_entry_bytes
from quantizer.fit.placement import Options, rank_weights
from quantizer.fit.residency import split_mapped
from quantizer.fit.stored import StoredTensor
from quantizer.model.targets import DRAFT, ROUTED, targets
from quantizer.model.tensor_classes import DRAFTER, EMBED, ENGRAM_TABLE, ROUTED_EXPERT, VISION

FUSED, MIXED = "fused", "mixed"
NOT_READ = (EMBED, ENGRAM_TABLE, VISION)  # one row a token (the embedding, Engram's rows) or not run at decode


@dataclass(frozen=True)
class DecodeCost:
    """One engine's cost of a decode token of a pack on some Sparks (the worst rank's), and the rates it gives."""

    engine: str
    sparks: int
    context: int
    gib_per_token: float  # bytes the worst rank reads a token, in GiB
    gib_by_part: dict[str, float]
    launches_per_token: int
    graphed: bool  # launches inside CUDA graphs (False: issued one by one)
    reduces_per_token: int  # tensor-parallel all-reduces (0 on one Spark)
    layers_by_path: dict[str, int]  # trunk layers whose routed experts take each dispatch path
    draft_rows: int  # rows the drafter proposes a round (0: no drafter)
    draft_gib: float  # what the drafter's pass reads a round
    draft_launches: int
    draft_reduces: int
    tokens_per_second: float
    with_drafter: float | None  # tokens per second with the drafter (None: off)
    model: str  # what this number is, and where its constants come from

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        drafter = f", {self.with_drafter:.1f} with the drafter" if self.with_drafter else ""
        paths = ", ".join(f"{n} layers {path}" for path, n in self.layers_by_path.items() if n)
        return (f"decode (a model, docs/decode-speed.md): ~{self.tokens_per_second:.1f} tokens/s{drafter} on "
                f"{self.sparks} Spark{'s' if self.sparks > 1 else ''} in {self.engine} at {self.context:,} tokens; "
                f"{self.gib_per_token:.2f} GiB read and {self.launches_per_token:,} kernel launches a token "
                f"({'in CUDA graphs' if self.graphed else 'eager'}; routed experts: {paths})")


def rates(cost: DecodeCost, k: Decoding) -> tuple[float, float | None]:
    """(tokens per second, and with the drafter) of a cost's bytes, launches and all-reduces under the constants `k`:
    a token's time is its bytes over the bandwidth plus each launch and all-reduce; a round verifies draft + 1 rows
    (a token's time x (1 + verify_row_cost x draft)) after the drafter's own pass, and yields the drafts accepted in
    a row (each with draft_acceptance) plus one."""
    launch = k.graph_launch_us if cost.graphed else k.eager_launch_us

    def seconds(gib: float, launches: int, reduces: int) -> float:
        return gib * GIB / (k.bandwidth_gbps * 1e9) + (launches * launch + reduces * k.allreduce_us) * 1e-6

    token = seconds(cost.gib_per_token, cost.launches_per_token, cost.reduces_per_token)
    if not cost.draft_rows:
        return 1 / token, None
    round_ = token * (1 + k.verify_row_cost * cost.draft_rows) + seconds(cost.draft_gib, cost.draft_launches,
                                                                        cost.draft_reduces)
    return 1 / token, sum(k.draft_acceptance ** i for i in range(cost.draft_rows + 1)) / round_


def layer_paths(cfg: ModelConfig, plan: Plan, profile: LoaderProfile, block: str = "layers") -> dict[int, str]:
    """Trunk layer (or drafter block) -> the dispatch path its routed experts take in the profile's engine: fused
    where every expert shares the K tuple the engine's fused kernel takes (one K per projection with gate = up, or
    one K for all three: profile.layouts.fused_tie), else mixed."""
    ks: dict[int, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    group = ROUTED if block == "layers" else DRAFT
    for t in targets(cfg):
        if t.group == group and t.expert is not None:
            ks[t.layer][t.proj].add(plan.k[t.key])
    decode = profile.decode
    out = {}
    for layer, by_proj in ks.items():
        uniform = all(len(v) == 1 for v in by_proj.values())
        gate, up, down = (next(iter(by_proj[p])) for p in ("w1", "w3", "w2")) if uniform else (None, 0, 1)
        tied = gate == up == down if profile.layouts.fused_tie == ALL_PROJECTIONS else gate == up
        out[layer] = FUSED if decode.mixed_is_fused or (uniform and tied) else MIXED
    return out


def decode_cost(cfg: ModelConfig, plan: Plan, stored: list[StoredTensor], profile: LoaderProfile, sparks: int,
                hw: Hardware, context: int, drafter: bool, routing: dict[int, list[float]] | None = None,
                graphed: bool | None = None) -> DecodeCost:
    """The cost of a decode token of `plan` (stored as `stored`) on `sparks` Sparks in the profile's engine, at
    `context` tokens; `routing` gives each trunk layer's routed selections per expert (None: uniform). `graphed`
    overrides whether the engine runs the step in CUDA graphs (vLLM's --enforce-eager). The drafter counts where it
    runs: asked for, drafting in this engine, and not barred by a mixed-K layer (Dispatch.mixed_drafts)."""
    d = profile.decode
    paths = layer_paths(cfg, plan, profile)
    fused = all(p == FUSED for p in paths.values())
    if graphed is None:
        graphed = d.graphs == "all" or (d.graphs == "fused" and fused)
    one, by_part = _bytes(cfg, stored, profile, sparks, hw, context, routing)
    drafts = drafter and d.draft and (d.mixed_drafts or fused)
    counts = defaultdict(int)
    for path in paths.values():
        counts[path] += 1
    cost = DecodeCost(
        profile.fit_engine, sparks, context, one / GIB, {p: round(b / GIB, 4) for p, b in by_part.items()},
        _launches(cfg, d, paths), graphed, (2 * cfg.num_layers + 1) * (sparks > 1), dict(sorted(counts.items())),
        d.draft if drafts else 0, _drafter_bytes(cfg, stored, profile, sparks, hw, d.draft) / GIB if drafts else 0.0,
        _drafter_launches(cfg, plan, profile, d.draft) if drafts else 0,
        (2 * cfg.num_mtp_blocks + 1) * (sparks > 1) if drafts else 0, 0.0, None, f"{hw.decode.source}; {d.source}")
    plain, with_drafter = rates(cost, hw.decode)
    return replace(cost, tokens_per_second=plain, with_drafter=with_drafter)


def _resident(stored: list[StoredTensor], hw: Hardware, profile: LoaderProfile) -> list[StoredTensor]:
    """The tensors as the engine holds them: a mapped engine's dequantized FP16 copies in place of source-form
    linears (what it reads), everything else as stored."""
    serving = hw.engine(profile.fit_engine).mapped
    if serving is None:
        return stored
    copied, mapped = split_mapped(stored, serving, serving.copy_default)
    return copied + mapped


def _bytes(cfg: ModelConfig, stored: list[StoredTensor], profile: LoaderProfile, sparks: int, hw: Hardware,
           context: int, routing: dict[int, list[float]] | None) -> tuple[float, dict[str, float]]:
    """(bytes the worst rank reads a token, by part)."""
    resident = [t for t in _resident(stored, hw, profile) if t.cls not in NOT_READ and t.cls != DRAFTER]
    engine = hw.engine(profile.fit_engine)
    options = Options(sparks, tp=engine.tensor_parallel, vision="off", drafter="off")
    ranks = rank_weights(cfg, resident, options).by_class
    worst = max(range(sparks), key=lambda r: sum(ranks[r].values()))
    per_rank = ranks[worst]
    routed_total = sum(t.nbytes for t in resident if t.cls == ROUTED_EXPERT)
    share = per_rank.get(ROUTED_EXPERT, 0) / routed_total if routed_total else 0.0
    parts = {cls: float(n) for cls, n in per_rank.items() if cls != ROUTED_EXPERT}
    parts[ROUTED_EXPERT] = share * _routed_read(cfg, resident, routing)
    parts["kv"] = _kv_read(cfg, engine, context)
    return sum(parts.values()), parts


def _routed_read(cfg: ModelConfig, resident: list[StoredTensor], routing: dict[int, list[float]] | None) -> float:
    """Expected routed-expert bytes a token reads: each expert's bytes times the chance the token selects it,
    top_k x its share of the layer's selections (uniform without a calibration)."""
    by_expert: dict[tuple[int, int], int] = defaultdict(int)
    for t in resident:
        if t.cls == ROUTED_EXPERT:
            parts = t.name.split(".")
            by_expert[int(parts[1]), int(parts[4])] += t.nbytes
    total = 0.0
    for (layer, expert), nbytes in by_expert.items():
        counts = (routing or {}).get(layer)
        share = counts[expert] / sum(counts) if counts and sum(counts) else 1 / cfg.n_routed_experts
        total += nbytes * min(1.0, cfg.experts_per_token * share)
    return total


def _kv_read(cfg: ModelConfig, engine, context: int) -> float:
    """Bytes one row reads of the caches at `context` tokens: each layer's sliding window and at most index_topk
    compressed entries, and each index layer's scan over its keys (one per `ratio` tokens)."""
    fmt = "fp16" if engine.kv_derive == "fp16" else "native"
    entry, key = kv_entry_bytes(cfg, fmt)
    window = min(context, cfg.sliding_window) * (2 * cfg.head_dim if fmt == "fp16" else entry)
    total = 0.0
    for layer in range(cfg.num_layers):
        ratio = cfg.ratio(layer)
        total += window
        if ratio:
            total += min(context // ratio, cfg.index_topk) * entry
            if cfg.is_index_source(layer):
                total += context // ratio * key
    return total


def _drafter_bytes(cfg: ModelConfig, stored: list[StoredTensor], profile: LoaderProfile, sparks: int, hw: Hardware,
                   draft: int) -> float:
    """What the drafter's pass over `draft` rows reads on the worst rank: its dense tensors, the experts those rows
    select (uniform over its experts), and the head once more (it shares the trunk's)."""
    resident = [t for t in _resident(stored, hw, profile) if t.cls in (DRAFTER, "head")]
    engine = hw.engine(profile.fit_engine)
    ranks = rank_weights(cfg, resident, Options(sparks, tp=engine.tensor_parallel, vision="off")).by_class
    worst = max(sum(r.values()) for r in ranks)
    experts = cfg.experts_in("mtp")
    chance = 1 - (1 - min(1.0, cfg.dspark_experts_per_token / experts)) ** draft if experts else 1.0
    expert_bytes = sum(t.nbytes for t in resident if t.cls == DRAFTER and ".ffn.experts." in t.name) / sparks
    return worst - expert_bytes * (1 - chance)


def _launches(cfg: ModelConfig, d, paths: dict[int, str]) -> int:
    """Launches of a token: per token, per layer, and each layer's MoE path (a mixed path's per-expert launches for
    each of the top_k experts)."""
    moe = sum(d.fused_launches if p == FUSED else d.mixed_launches + cfg.experts_per_token * d.mixed_per_expert
              for p in paths.values())
    return d.token_launches + cfg.num_layers * d.layer_launches + moe


def _drafter_launches(cfg: ModelConfig, plan: Plan, profile: LoaderProfile, draft: int) -> int:
    d = profile.decode
    paths = layer_paths(cfg, plan, profile, block="mtp")
    experts = cfg.experts_in("mtp")
    active = experts * (1 - (1 - cfg.dspark_experts_per_token / experts) ** draft) if experts else 0
    return sum(d.layer_launches + (d.fused_launches if p == FUSED else d.mixed_launches + math.ceil(active)
                                   * d.mixed_per_expert) for p in paths.values())
