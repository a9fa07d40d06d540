"""A uniform plan at a target bpw, the way exllamav3's allocator spends `-b` with `-hq 1`.

Attention, the indexer query, shared experts and Engram's wkv get a fixed floor: the integer
rate_floor(bpw + 2), at least 4 (exllamav3 -hq 1 clamps modules with select_hq_bits 2 up to
rate_floor(bpw + 2); DSV4 attention takes integer K only). The head gets head_bits (6). The
routed experts take the rest of the budget (bpw x the budgeted weights): one rate per layer,
two adjacent rates across layers, the layers nearest either end of the stack promoted first
(exllamav3 groups all experts of a layer and bumps end layers first); with the per-expert layout the
unit is one expert, so a layer may hold both rates, and with the grouped one a group of a layer's
experts (by index: a uniform plan knows no importance). Half rates only where the profile (or
`half_rates`) allows them. The DSpark drafter stays
native unless drafter_bits is given (quantizing it costs draft acceptance). The loader profile decides
what is budgeted: a group its engine keeps in source form (vllm-exl3: all but the routed experts) stays
native and outside the budget, and the head and drafter follow the profile (profiles.group_k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import GROUPED, PER_LAYER, ExpertLayout, LoaderProfile, Overlay, stock_profile
from quantizer.contract.loader_profiles import overlay_note
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.exl3 import check_k, k_words, rate_floor, rate_grid
from quantizer.model.targets import DRAFT, ROUTED, targets

MIN_FLOOR = 4.0


def floor_rate(bpw: float) -> float:
    """K for attention, indexer, shared experts and Engram wkv: integer rate_floor(bpw + 2), >= 4."""
    return max(MIN_FLOOR, rate_floor(bpw + 2, rate_grid("mcg")))


def uniform_plan(
    cfg: ModelConfig,
    bpw: float,
    codebook: str = "mul1",
    head_bits: float | None = 6,
    drafter_bits: float | None = None,
    floor: float | None = None,
    profile: LoaderProfile | None = None,
    overlay: Overlay | None = None,
    expert_layout: str | None = None,
    half_rates: bool | None = None,
) -> Plan:
    """One K per layer's routed experts (per expert or per group of experts under those layouts, so the budget
    is spent to the unit), whose budgeted bits come to at most `bpw` (exllamav3's `bits` accounting), for
    `profile` (None: stock exllamav3)."""
    all_targets = targets(cfg)
    profile = profile or stock_profile()
    layout = profile.expert_layout(expert_layout)
    budgeted = [t for t in all_targets if profile.budgets(t)]
    routed = [t for t in budgeted if t.group == ROUTED]
    terms = _budget_terms(budgeted, codebook, profile, half_rates)
    fixed = floor_rate(bpw) if floor is None else check_k(floor, codebook, True, "floor")
    budget = bpw * terms.budgeted_numel - fixed * terms.others_numel
    routed_numel, grid = terms.routed_numel, terms.grid
    average = budget / routed_numel
    if average < grid[0]:
        raise UserError(
            f"--bpw {bpw:g} is too low: the K {fixed:g} floor of attention, shared experts and indexer "
            f"leaves {average:.2f} bits per routed weight, below the lowest rate {grid[0]:g}"
        )
    low = rate_floor(min(average, grid[-1]), grid)
    high = grid[min(grid.index(low) + 1, len(grid) - 1)]
    unit = _unit(layout, cfg.n_routed_experts)
    unit_numel: dict[tuple, int] = {}
    for t in routed:
        unit_numel[unit(t)] = unit_numel.get(unit(t), 0) + t.numel
    spare = budget - low * routed_numel
    unit_k = {u: low for u in unit_numel}
    for u in sorted(unit_numel, key=lambda u: (min(u[0], cfg.num_layers - 1 - u[0]), u)):
        cost = (high - low) * unit_numel[u]
        if high == low or cost > spare + 1e-6:
            break
        unit_k[u] = high
        spare -= cost
    k: dict[str, float | None] = {}
    for t in all_targets:
        if t.group == ROUTED:
            k[t.key] = unit_k[unit(t)]
        elif profile.budgets(t):
            k[t.key] = fixed
        else:  # head, drafter, an overlay, or a group the engine keeps in source form
            k[t.key] = profile.fixed_k(t, head_bits, drafter_bits, overlay)
    drafter = sorted({k[t.key] for t in all_targets if t.group == DRAFT}, key=lambda x: -1 if x is None else x)
    others = f", the other budgeted tensors at {fixed:g} bits" if terms.others_numel else ""
    made_by = (f"a uniform {bpw:g} bpw plan ({codebook} codebook, routed experts at "
               f"{' / '.join(f'{x:g}' for x in sorted(set(unit_k.values())))} bits, {layout.describe()}{others}, "
               f"head {k_words(k.get('head'))}, "
               f"drafter {' / '.join(map(k_words, drafter)) or 'none'}{overlay_note(overlay)})")
    return make_plan(cfg, k, codebook, profile, target_bpw=bpw, made_by=made_by)


@dataclass(frozen=True)
class BudgetTerms:
    """What a uniform plan's budget arithmetic needs of a model under a profile."""

    budgeted_numel: int
    routed_numel: int
    others_numel: int  # budgeted, not routed: they take the fixed floor
    grid: tuple[float, ...]  # the routed rates the profile takes with this codebook


def _unit(layout: ExpertLayout, experts: int):
    """Target -> the unit that takes one K: a layer's experts, one expert, or one of a layer's expert groups."""
    if layout.name == PER_LAYER:
        return lambda t: (t.layer, None)
    if layout.name == GROUPED:
        size = max(layout.min_group, -(-experts // layout.groups))
        return lambda t: (t.layer, t.expert // size)
    return lambda t: (t.layer, t.expert)


def _budget_terms(budgeted: list, codebook: str, profile, half_rates: bool | None = None) -> BudgetTerms:
    """From the targets the profile budgets."""
    routed = sum(t.numel for t in budgeted if t.group == ROUTED)
    total = sum(t.numel for t in budgeted)
    halves = profile.layouts.half_rates if half_rates is None else half_rates
    grid = tuple(r for r in rate_grid(codebook) if profile.k_min <= r <= profile.k_max  # make_plan checks the codebook
                 and (r == int(r) or (halves and codebook in profile.half_rate_codebooks)))
    return BudgetTerms(total, routed, total - routed, grid)


def lowest_uniform_bpw(cfg: ModelConfig, codebook: str = "mul1", floor: float | None = None,
                       profile: LoaderProfile | None = None, half_rates: bool | None = None) -> float:
    """The lowest bpw uniform_plan accepts: where the fixed floor leaves the routed experts exactly the
    grid's lowest rate. In closed form, so a search for the most bits that fit starts there instead of
    bisecting from 1 bpw (each accepted probe plans the whole model: about a second at full size)."""
    profile = profile or stock_profile()
    terms = _budget_terms([t for t in targets(cfg) if profile.budgets(t)], codebook, profile, half_rates)
    fixed_rates = sorted({MIN_FLOOR, *(r for r in rate_grid("mcg") if r >= MIN_FLOOR)}) if floor is None else [floor]
    for fixed in fixed_rates:  # floor_rate grows with bpw, and so does the bpw each floor needs
        bpw = (terms.grid[0] * terms.routed_numel + fixed * terms.others_numel) / terms.budgeted_numel
        bpw = math.nextafter(bpw, math.inf)  # at the root, rounding may leave the routed average a hair short
        if floor is not None or floor_rate(bpw) == fixed:
            return bpw
    raise UserError(f"no uniform plan exists for {profile.name} with codebook {codebook}")
