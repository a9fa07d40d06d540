"""A uniform plan at a target bpw, the way exllamav3's allocator spends `-b` with `-hq 1`.

Attention, the indexer query, shared experts and Engram's wkv get a fixed floor: the integer
rate_floor(bpw + 2), at least 4 (exllamav3 -hq 1 clamps modules with select_hq_bits 2 up to
rate_floor(bpw + 2); DSV4 attention takes integer K only). The head gets head_bits (6). The
routed experts take the rest of the budget (bpw x the budgeted weights): one rate per layer,
two adjacent rates across layers, the layers nearest either end of the stack promoted first
(exllamav3 groups all experts of a layer and bumps end layers first). The DSpark drafter stays
native unless drafter_bits is given (quantizing it costs draft acceptance).
"""

from __future__ import annotations

from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.exl3 import check_k, rate_grid
from quantizer.model.targets import DRAFT, HEAD_GROUP, ROUTED, targets
from quantizer.plan.plan import Plan, make_plan
from quantizer.plan.profiles import EXLLAMAV3

MIN_FLOOR = 4.0


def rate_floor(x: float, grid: tuple[float, ...]) -> float:
    """The largest rate of `grid` at or below x (the smallest rate if x is below them all)."""
    below = [r for r in grid if r <= x + 1e-9]
    return below[-1] if below else grid[0]


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
    loader: str = EXLLAMAV3,
) -> Plan:
    """One K per projection per layer (any loader takes it), whose budgeted bits come to at most `bpw`
    (exllamav3's `bits` accounting)."""
    all_targets = targets(cfg)
    budgeted = [t for t in all_targets if t.budgeted]
    routed = [t for t in budgeted if t.group == ROUTED]
    others = [t for t in budgeted if t.group != ROUTED]
    fixed = floor_rate(bpw) if floor is None else check_k(floor, codebook, True, "floor")
    budget = bpw * sum(t.numel for t in budgeted) - fixed * sum(t.numel for t in others)
    layer_numel: dict[int, int] = {}
    for t in routed:
        layer_numel[t.layer] = layer_numel.get(t.layer, 0) + t.numel
    grid = rate_grid(codebook)
    average = budget / sum(layer_numel.values())
    if average < grid[0]:
        raise UserError(
            f"--bpw {bpw:g} is too low: the K {fixed:g} floor of attention, shared experts and indexer "
            f"leaves {average:.2f} bits per routed weight, below the lowest rate {grid[0]:g}"
        )
    low = rate_floor(min(average, grid[-1]), grid)
    high = grid[min(grid.index(low) + 1, len(grid) - 1)]
    spare = budget - low * sum(layer_numel.values())
    layer_k = {layer: low for layer in layer_numel}
    for layer in sorted(layer_numel, key=lambda L: (min(L, cfg.num_layers - 1 - L), L)):
        cost = (high - low) * layer_numel[layer]
        if high == low or cost > spare + 1e-6:
            break
        layer_k[layer] = high
        spare -= cost
    k: dict[str, float | None] = {}
    for t in all_targets:
        if t.group == ROUTED:
            k[t.key] = layer_k[t.layer]
        elif t.budgeted:
            k[t.key] = fixed
        elif t.group == HEAD_GROUP:
            k[t.key] = head_bits
        elif t.group == DRAFT:
            k[t.key] = drafter_k(drafter_bits, t.integer_only)
    made_by = (f"uniform_plan(bpw={bpw:g}, codebook={codebook}, head_bits={head_bits}, "
               f"drafter_bits={drafter_bits}, floor={fixed:g})")
    return make_plan(cfg, k, codebook, loader, target_bpw=bpw, made_by=made_by)


def drafter_k(bits: float | None, integer_only: bool) -> float | None:
    """The drafter's rate; its attention rounds down to an integer (DSV4 attention)."""
    if bits is None:
        return None
    return rate_floor(bits, rate_grid("mcg")) if integer_only else bits
