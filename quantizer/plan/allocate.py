"""Allocation: K per target under a bit budget, minimising the total estimated cost (sensitivity.py).

The budget is exllamav3's `bits` accounting (what `uniform_plan` and `achieved_bpw` use): bits over
the budgeted targets, sum(numel x K) <= bpw x sum(numel); an aliased cold expert stores nothing.

Marginal analysis: every unit starts at its lowest allowed rate; the candidate upgrades of a unit
are the segments of the lower convex hull of its (bits, cost) options, so a rate whose step is
worse than the one after it (a non-convex step) does not stop the unit. All segments, best
cost-per-bit first, are taken while they fit; this prefix is the Lagrangian optimum, exact for
the bits it spends. What is left is filled by the best upgrades (any rate, hull or not) that still
fit. The loader profile (contract/loader_profiles.py) decides what is allocated (only the groups its engine quantizes:
for `vllm-exl3` the routed experts, the rest is a fixed cost in bytes) and the units: one tensor where
the loader takes K per expert (`vllm-exl3`, `tensorfold`); under `exllamav3` the routed experts of one
layer share one K per projection and gate and up share one K, so a layer's gate+up is one unit and
its down another, cost and bits summed over their tensors. A profile's constraint is part of the problem, never a repair after it.

Rules: the profile's (codebook, K range, integer K for DSV4 attention, compressor and indexer; half
rates only with mul1), and attention, indexer, shared experts and Engram's wkv start at `floor`.
The head takes `head_bits` and the DSpark drafter `drafter_bits` (native by default), both outside
the budget as in exllamav3.

Cold experts (routed share below `alias_below` x the layer's mean, with an alias candidate from
calibration) may be served by their warm expert: 0 bits, cost = importance x aliasing error. The
choice is Lagrangian: alias when that cost is below what keeping the expert costs, its bits priced
at the marginal value of bits in the current solution; at most `alias_cap` per layer; re-solved
until the alias set is stable. On by default where the profile's loader honours aliases; no engine
profile reads an alias map today (docs/loader-profiles.md), so `--alias` is refused with one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import (
    ALL_PROJECTIONS,
    GROUPED,
    PER_LAYER,
    ExpertLayout,
    LoaderProfile,
    Overlay,
    overlay_note,
    stock_profile,
)
from quantizer.contract.pack_spec import expert_of
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.exl3 import check_k, k_words, rate_grid
from quantizer.model.targets import ATTN, ENGRAM, INDEX, ROUTED, SHARED, target_map, targets
from quantizer.plan.sensitivity import AliasOption, Sensitivity

FLOORED = (ATTN, INDEX, SHARED, ENGRAM)
# K 2, the lowest integer rate DSV4 attention takes: measured in exllamav3 on the small V4 model it cuts
# KL against a K 3 floor by 14% at 2.5 bpw, 6% at 2.9 and ~1% at 3.5 (README, Measured)
DEFAULT_FLOOR = 2.0
ALIAS_BELOW = 0.02  # alias candidates: routed share under 2% of the layer's mean (~dead experts)
ALIAS_CAP_SHARE = 1 / 16  # at most this share of a layer's experts aliased (24 of 384)
ALIAS_ROUNDS = 6


@dataclass(frozen=True)
class AllocationSettings:
    profile: LoaderProfile = field(default_factory=stock_profile)  # the engine the plans are for
    codebook: str = "mul1"
    floor: float = DEFAULT_FLOOR
    head_bits: float | None = 6.0
    drafter_bits: float | None = None
    alias: bool | None = None  # None: on where the loader honours aliases
    alias_below: float = ALIAS_BELOW
    alias_cap: int | None = None  # per layer; None: ALIAS_CAP_SHARE of the experts, at least 1
    overlay: Overlay | None = None  # EXL3 for the profile's overlay groups at fixed K (profiles.Overlay)
    expert_layout: str | None = None  # per-expert | grouped | per-layer; None: the profile's default
    half_rates: bool | None = None  # whether K may be 1.5 / 2.5 / 3.5; None: the profile's default

    def record(self) -> dict:
        """What a resume must agree on, the profile by its name."""
        settings = asdict(self)  # the profile's rules come with its name; the record keeps the name
        return {"loader": self.profile.name} | {k: v for k, v in settings.items() if k != "profile"}

    @property
    def layout(self) -> ExpertLayout:
        """The routed experts' layout, checked against the profile (UserError for one its engine cannot load)."""
        return self.profile.expert_layout(self.expert_layout)

    @property
    def halves(self) -> bool:
        """Whether the allocator may use half rates; UserError where they are asked for and the engine reads
        integer K only (or only with another codebook)."""
        profile = self.profile
        if self.half_rates and self.codebook not in profile.half_rate_codebooks:
            where = f"with {' or '.join(profile.half_rate_codebooks)}" if profile.half_rate_codebooks else "integer K only"
            raise UserError(f"--half-rates: the {profile.name} engine reads half rates {where} "
                            f"({profile.sources['half_rates']})" if profile.half_rate_codebooks else
                            f"--half-rates: the {profile.name} engine reads {where} ({profile.sources['half_rates']})")
        return profile.layouts.half_rates if self.half_rates is None else self.half_rates

    @property
    def aliasing(self) -> bool:
        """Whether cold experts may be aliased; UserError where the loader cannot serve aliases."""
        allowed = self.profile.aliases
        if self.alias and not allowed:
            raise UserError(alias_refusal(self.profile.name))
        return allowed if self.alias is None else self.alias


def alias_refusal(loader: str) -> str:
    """The one line that refuses cold-expert aliases for a loader that reads no alias map."""
    return (f"--alias: the {loader} engine reads every expert's own tensors and no engine profile reads an alias "
            "map (docs/loader-profiles.md, cold-expert aliases), so a pack with aliased experts would miss them; "
            "drop --alias")


class Allocator:
    """One model, one sensitivity, one set of rules; `plan(bits)` for any budget (the fit search
    asks for several)."""

    def __init__(self, cfg: ModelConfig, sens: Sensitivity, settings: AllocationSettings | None = None,
                 profile: LoaderProfile | None = None):
        """`profile` in place of the settings' own: a profile whose rules the plans need not keep (what a bench
        that measures a layout no engine of the model loads asks for: bench/expert_layouts.py)."""
        self.keep_rules = profile is None
        settings = settings or AllocationSettings()
        profile = profile or settings.profile
        if settings.codebook not in profile.codebooks:
            raise UserError(f"--codebook {settings.codebook}: the {profile.name} loader takes "
                            f"{' or '.join(profile.codebooks)} ({profile.sources['codebook']})")
        if tuple(sens.rates) != rate_grid(settings.codebook):
            raise ValueError(f"sensitivity was computed for rates {sens.rates}, not the {settings.codebook} grid")
        floor = check_k(settings.floor, settings.codebook, True, "--floor")
        if floor not in sens.rates:
            raise UserError(f"--floor {floor:g}: choose an integer rate 1..8")
        self.cfg, self.sens, self.settings, self.profile = cfg, sens, settings, profile
        self.layout = profile.expert_layout(settings.expert_layout)
        tmap = target_map(cfg)
        # only what the engine quantizes is allocated; a group it keeps in source form is a fixed cost in bytes
        keep = [i for i, key in enumerate(sens.keys) if profile.budgets(tmap[key])]
        keys = tuple(sens.keys[i] for i in keep)
        self.targets = [tmap[k] for k in keys]
        self.rates = np.asarray(sens.rates)
        self.numel = np.array([t.numel for t in self.targets], dtype=float)
        by_kind = {}  # the profile's rule depends on the target only through its group and integer_only
        for t in self.targets:
            if (t.group, t.integer_only) not in by_kind:
                by_kind[t.group, t.integer_only] = [profile.allows_k(float(r), settings.codebook, t) for r in self.rates]
        allowed = np.array([by_kind[t.group, t.integer_only] for t in self.targets], dtype=bool).reshape(
            len(self.targets), len(self.rates))
        for i, t in enumerate(self.targets):
            if t.group in FLOORED:
                allowed[i] &= self.rates >= floor
        if not settings.halves:
            allowed &= self.rates[None, :] == np.floor(self.rates)[None, :]
        self.cost = np.where(allowed, sens.cost[keep], np.inf)
        self.bits = self.numel[:, None] * self.rates[None, :]
        self.row = {k: i for i, k in enumerate(keys)}
        self.expert_group = self._expert_groups() if self.layout.name == GROUPED else {}
        self.expert_rows = _expert_rows(keys)
        self.candidates = self._alias_candidates() if settings.aliasing else ()
        self.total_numel = float(self.numel.sum())

    # ---- budget ---------------------------------------------------------------------------------

    @property
    def min_bits(self) -> float:
        """Bits of every target at its lowest allowed rate, with nothing aliased."""
        return float(np.where(np.isfinite(self.cost), self.bits, np.inf).min(axis=1).sum())

    @property
    def max_bits(self) -> float:
        return float(np.where(np.isfinite(self.cost), self.bits, -np.inf).max(axis=1).sum())

    def plan(self, budget_bits: float, target_bpw: float | None = None) -> Plan:
        """The allocation for `budget_bits`, as a checked Plan; UserError when even the lowest
        rates need more."""
        aliased: dict[str, str] = {}
        try:
            for _ in range(ALIAS_ROUNDS):
                choice, lam = self._solve(budget_bits, aliased)
                chosen = self._choose_aliases(lam)
                if chosen == aliased:
                    break
                aliased = chosen
            else:
                choice, lam = self._solve(budget_bits, aliased)
        except InfeasibleBudget as e:
            floor = self.settings.floor
            raise UserError(
                f"--bpw {budget_bits / self.total_numel:.4g} is too low: the lowest rates (K{floor:g} floor on "
                f"attention, indexer, shared experts and Engram wkv, K{self.rates[0]:g} for routed experts) need "
                f"{e.needed / self.total_numel:.3f} bpw") from None
        return self._to_plan(choice, aliased, budget_bits, target_bpw)

    # ---- the marginal solver --------------------------------------------------------------------

    def _units(self, aliased: dict[str, str]) -> np.ndarray:
        """Unit index per row (-1: aliased): one per tensor, except where the layout ties routed tensors to
        one K (ExpertLayout.tie): per-layer, a layer's experts per projection (gate with up, or all three
        projections, as the engine's fused path takes them); grouped, the experts of one of a layer's groups
        (expert_groups) across all three projections; per-expert, gate with up where the profile ties them."""
        unit = np.arange(len(self.targets))
        units: dict[tuple, int] = {}
        layout = self.layout
        for i, t in enumerate(self.targets):
            if t.group != ROUTED:
                continue
            gate_up = "w1+w3" if t.proj in ("w1", "w3") else t.proj
            proj = gate_up if self.profile.tie_gate_up else t.proj
            if layout.name == PER_LAYER:
                who, proj = None, ALL_PROJECTIONS if layout.tie == ALL_PROJECTIONS else gate_up
            elif layout.name == GROUPED:
                who, proj = ("group", self.expert_group[t.layer, t.expert]), ALL_PROJECTIONS
            else:
                who = t.expert
            unit[i] = units.setdefault((t.layer, who, proj), i)
        for expert in aliased:
            unit[self.expert_rows[expert]] = -1
        return unit

    def _expert_groups(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> its group: a layer's experts ranked by what leaving them at the lowest rate costs,
        most first, and cut into layout.groups groups of equal count (at least layout.min_group experts each)."""
        at_stake = np.where(np.isfinite(self.cost), self.cost, -np.inf).max(axis=1) - self.cost.min(axis=1)
        stake: dict[int, dict[int, float]] = {}
        for i, t in enumerate(self.targets):
            if t.group == ROUTED:
                stake.setdefault(t.layer, {}).setdefault(t.expert, 0.0)
                stake[t.layer][t.expert] += float(at_stake[i])
        layout, out = self.layout, {}
        for layer, experts in stake.items():
            ranked = sorted(experts, key=lambda e: (-experts[e], e))
            size = max(layout.min_group, -(-len(ranked) // layout.groups))
            for rank, e in enumerate(ranked):
                out[layer, e] = rank // size
        return out

    def _solve(self, budget_bits: float, aliased: dict[str, str]) -> tuple[np.ndarray, float]:
        """Rate index per row (an aliased row holds its warm expert's) and the marginal value of a
        bit (cost per bit of the best upgrade left out)."""
        unit = self._units(aliased)
        live = unit >= 0
        ids, inverse = np.unique(unit[live], return_inverse=True)
        cost = np.zeros((len(ids), len(self.rates)))
        bits = np.zeros_like(cost)
        np.add.at(cost, inverse, self.cost[live])
        np.add.at(bits, inverse, self.bits[live])
        pick, lam = marginal_allocation(bits, cost, budget_bits)
        choice = np.zeros(len(self.targets), dtype=int)
        choice[live] = pick[inverse]
        for cold, warm in aliased.items():
            choice[self.expert_rows[cold]] = choice[self._warm_rows(cold, warm)]
        return choice, lam

    def _warm_rows(self, cold: str, warm: str) -> list[int]:
        """The warm expert's rows, projection by projection, for the cold expert's rows."""
        return [self.row[warm + self.targets[i].key[len(cold):]] for i in self.expert_rows[cold]]

    # ---- aliases --------------------------------------------------------------------------------

    def _alias_candidates(self) -> tuple[AliasOption, ...]:
        s = self.settings
        return tuple(a for a in self.sens.aliases if a.relative_share < s.alias_below and a.expert in self.expert_rows
                     and a.warm in self.expert_rows)

    def _cap(self) -> int:
        if self.settings.alias_cap is not None:
            return self.settings.alias_cap
        return max(1, int(self.cfg.n_routed_experts * ALIAS_CAP_SHARE))

    def _choose_aliases(self, lam: float) -> dict[str, str]:
        """Alias where cost + lam x bits of keeping the expert (at its Lagrangian-best rates: a loader
        that honours aliases takes K per expert) exceeds its aliasing cost."""
        if not self.candidates:
            return {}
        kept = (self.cost + lam * self.bits).min(axis=1)
        net = {a.expert: a.cost - float(kept[self.expert_rows[a.expert]].sum()) for a in self.candidates}
        chosen: dict[str, str] = {}
        warms: set[str] = set()
        per_layer: dict[int, int] = {}
        for a in sorted(self.candidates, key=lambda a: net[a.expert]):
            if net[a.expert] >= 0:
                break
            if per_layer.get(a.layer, 0) >= self._cap() or a.expert in warms or a.warm in chosen:
                continue
            chosen[a.expert] = a.warm
            warms.add(a.warm)
            per_layer[a.layer] = per_layer.get(a.layer, 0) + 1
        return chosen

    # ---- result ---------------------------------------------------------------------------------

    def _to_plan(self, choice: np.ndarray, aliased: dict[str, str], budget_bits: float,
                 target_bpw: float | None) -> Plan:
        s = self.settings
        # an aliased expert's rows read as its warm expert's (_solve)
        k: dict[str, float | None] = {key: float(self.rates[choice[i]]) for key, i in self.row.items()}
        for t in targets(self.cfg):
            if t.key not in k:  # head, drafter, an overlay group, or one the engine keeps in source form
                k[t.key] = self.profile.fixed_k(t, s.head_bits, s.drafter_bits, s.overlay)
        bpw = budget_bits / self.total_numel if target_bpw is None else target_bpw
        floor = any(self.profile.budgets(t) and t.group != ROUTED for t in targets(self.cfg))
        made_by = (f"our allocator's {bpw:.4g} bpw plan ({s.codebook} codebook, routed experts {self.layout.describe()}"
                   + ("" if s.halves else ", integer K only")
                   + (f", the other budgeted tensors at {s.floor:g} bits or more" if floor else "")
                   + f", head {k_words(k.get('head'))}" + (f", {len(aliased)} aliased experts" if aliased else "")
                   + f", {'a synthetic' if self.sens.synthetic else 'a measured'} calibration with {self.sens.gains} "
                   f"site gains, proxy errors "
                   f"{f'measured for {self.sens.measured} targets' if self.sens.measured else 'modelled'}"
                   + overlay_note(s.overlay) + ")")
        return make_plan(self.cfg, k, s.codebook, s.profile, target_bpw=round(bpw, 4), aliases=aliased,
                         made_by=made_by, keep_rules=self.keep_rules)


def _expert_rows(keys: tuple[str, ...]) -> dict[str, list[int]]:
    """Routed expert (`layers.L.ffn.experts.E`) -> its rows (w1, w2, w3)."""
    rows: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if ".ffn.experts." in key and key.startswith("layers."):
            rows.setdefault(expert_of(key), []).append(i)
    return rows


def marginal_allocation(bits: np.ndarray, cost: np.ndarray, budget: float) -> tuple[np.ndarray, float]:
    """Option per unit minimising sum(cost) with sum(bits) <= budget; options are columns in
    increasing bits, cost inf where not allowed. Returns (option per unit, marginal value of a bit);
    InfeasibleBudget when even the first allowed options do not fit."""
    n_units, n_opts = cost.shape
    rows = np.arange(n_units)
    finite = np.isfinite(cost)
    start = finite.argmax(axis=1)
    used = float(bits[rows, start].sum())
    if used > budget * (1 + 1e-12):
        raise InfeasibleBudget(used, budget)
    # lower convex hull of each unit's options from its start (gift wrapping, at most n_opts steps)
    col = np.arange(n_opts)
    hull_to = np.full((n_units, n_opts), -1)
    seg_unit, seg_step, seg_bits, seg_gain = [], [], [], []
    cur, active = start.copy(), np.ones(n_units, dtype=bool)
    for step in range(n_opts):
        db = bits - bits[rows, cur][:, None]
        dc = cost - cost[rows, cur][:, None]
        ok = active[:, None] & finite & (col[None, :] > cur[:, None]) & (dc < 0)
        slope = np.full(cost.shape, np.inf)
        np.divide(dc, db, out=slope, where=ok)
        nxt = slope.argmin(axis=1)
        best = slope[rows, nxt]
        active = np.isfinite(best)
        if not active.any():
            break
        u = rows[active]
        hull_to[u, step] = nxt[active]
        seg_unit.append(u)
        seg_step.append(np.full(len(u), step))
        seg_bits.append(db[u, nxt[active]])
        seg_gain.append(-best[active])
        cur = np.where(active, nxt, cur)
    choice = start.copy()
    lam = 0.0
    if seg_unit:
        unit, step = np.concatenate(seg_unit), np.concatenate(seg_step)
        dbits, gain = np.concatenate(seg_bits), np.concatenate(seg_gain)
        order = np.lexsort((step, unit, -gain))  # best cost per bit first; a unit's segments in order
        cum = np.cumsum(dbits[order])
        taken = int(np.searchsorted(cum, budget - used, side="right"))
        last = np.full(n_units, -1)
        np.maximum.at(last, unit[order[:taken]], step[order[:taken]])
        moved = last >= 0
        choice[moved] = hull_to[rows[moved], last[moved]]
        used += float(cum[taken - 1]) if taken else 0.0
        lam = float(gain[order[taken]]) if taken < len(order) else 0.0
    _fill(bits, cost, choice, budget - used)
    return choice, lam


def _fill(bits: np.ndarray, cost: np.ndarray, choice: np.ndarray, left: float) -> None:
    """Spend what the hull prefix left: the best-cost-per-bit upgrade that still fits, until none."""
    rows = np.arange(len(choice))
    while True:
        db = bits - bits[rows, choice][:, None]
        dc = cost - cost[rows, choice][:, None]
        ok = np.isfinite(cost) & (db > 0) & (db <= left) & (dc < 0)
        if not ok.any():
            return
        score = np.full(cost.shape, -np.inf)
        np.divide(-dc, db, out=score, where=ok)
        u, j = np.unravel_index(int(score.argmax()), score.shape)
        left -= float(db[u, j])
        choice[u] = j


class InfeasibleBudget(Exception):
    def __init__(self, needed: float, budget: float):
        super().__init__(f"the lowest rates need {needed:.6g} bits, the budget is {budget:.6g}")
        self.needed, self.budget = needed, budget


# ---- entry points ---------------------------------------------------------------------------------

def allocate(cfg: ModelConfig, sens: Sensitivity, bpw: float,
             settings: AllocationSettings | None = None) -> Plan:
    """The plan whose budgeted bits come to at most `bpw` (exllamav3 accounting) at the least cost."""
    alloc = Allocator(cfg, sens, settings)
    return alloc.plan(bpw * alloc.total_numel, target_bpw=bpw)
