"""plan/allocate.py on small models: marginal analysis against brute force, the rate rules
(floors, integer attention, half rates only with mul1, head, drafter), stock groups, the budget
against uniform and exllamav3-style plans, cold-expert aliases, recipes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import EXLLAMAV3, TENSORFOLD, VLLM_EXL3, load_profile
from quantizer.contract.pack_spec import aliased_keys
from quantizer.contract.plan import Plan
from quantizer.contract.rules import check_plan
from quantizer.errors import UserError
from quantizer.model.targets import ATTN, DRAFT, ENGRAM, INDEX, ROUTED, SHARED, targets
from quantizer.plan.allocate import (
    DEFAULT_FLOOR,
    AllocationSettings,
    Allocator,
    InfeasibleBudget,
    allocate,
    marginal_allocation,
)
from quantizer.plan.recipe import plan_from_recipe, read_recipe, write_recipe
from quantizer.plan.sensitivity import Sensitivity, sensitivity, synthetic_summary
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path


@pytest.fixture(scope="module")
def small():
    return ModelConfig.from_file(model_config_path("small-v41.json"))


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_file(model_config_path("tiny-v41.json"))


@pytest.fixture(scope="module")
def small_sens(small):
    return sensitivity(small, synthetic_summary(small, seed=1))


def plan_cost(sens: Sensitivity, plan: Plan) -> float:
    """Estimated cost of a plan under `sens` (aliased experts at their alias cost)."""
    col = {r: i for i, r in enumerate(sens.rates)}
    cold = aliased_keys(plan)
    total = sum(c for key, c in zip(sens.keys, sens.cost[np.arange(len(sens.keys)),
                                                          [col[plan.k[k]] for k in sens.keys]]) if key not in cold)
    return total + sum(a.cost for a in sens.aliases if a.expert in plan.aliases)


def budget_bytes(cfg: ModelConfig, plan: Plan) -> int:
    """Stored bytes of the budgeted tensors' classes (what the methods trade against each other)."""
    classes = {t.cls for t in targets(cfg) if t.budgeted}
    return sum(n for c, n in plan.expected_bytes.items() if c in classes)


def brute_force(bits: np.ndarray, cost: np.ndarray, budget: float) -> float:
    best = np.inf
    rows = np.arange(len(cost))
    for combo in itertools.product(range(cost.shape[1]), repeat=len(cost)):
        if bits[rows, combo].sum() <= budget + 1e-9:
            best = min(best, cost[rows, combo].sum())
    return best


def random_problem(rng: np.random.Generator):
    units, opts = int(rng.integers(2, 5)), int(rng.integers(3, 6))
    numel = rng.integers(1, 5, units).astype(float)
    rates = np.sort(rng.choice(np.arange(1, 9, 0.5), opts, replace=False))
    bits = numel[:, None] * rates[None, :]
    cost = np.sort(rng.exponential(1, (units, opts)), axis=1)[:, ::-1] * rng.uniform(0.1, 3, (units, 1))
    cost = cost + rng.normal(0, 0.05, cost.shape)  # non-convex, sometimes non-monotone steps
    disallowed = rng.random((units, opts)) < 0.15
    disallowed[:, -1] = False
    return bits, np.where(disallowed, np.inf, cost)


def lagrangian(bits: np.ndarray, cost: np.ndarray, lam: float) -> np.ndarray:
    """argmin over options of cost + lam x bits, per unit."""
    return np.where(np.isfinite(cost), cost + lam * bits, np.inf).argmin(axis=1)


def test_marginal_allocation_is_exact_at_lagrangian_budgets():
    """Everett: a Lagrangian solution is optimal for the bits it spends; at those budgets the hull
    prefix stops exactly there, so the solver matches brute force."""
    rng = np.random.default_rng(11)
    for _ in range(80):
        bits, cost = random_problem(rng)
        rows = np.arange(len(bits))
        for lam in rng.exponential(0.3, 6):
            x = lagrangian(bits, cost, lam)
            budget = float(bits[rows, x].sum())
            choice, _ = marginal_allocation(bits, cost, budget)
            best = brute_force(bits, cost, budget)
            assert cost[rows, x].sum() == pytest.approx(best)
            assert cost[rows, choice].sum() == pytest.approx(best)


def test_marginal_allocation_near_optimal_at_any_budget():
    """Between those budgets the gap to brute force is bounded by the Lagrangian dual: at most the
    marginal value of a bit times the bits above the lowest rates; most budgets are still exact."""
    rng = np.random.default_rng(7)
    exact = total = 0
    for _ in range(100):
        bits, cost = random_problem(rng)
        rows = np.arange(len(bits))
        lowest = float(bits[rows, np.isfinite(cost).argmax(1)].sum())
        top = float(np.where(np.isfinite(cost), bits, 0).max(axis=1).sum())
        for budget in np.linspace(lowest, top, 6):
            choice, lam = marginal_allocation(bits, cost, budget)
            got, best = cost[rows, choice].sum(), brute_force(bits, cost, budget)
            assert bits[rows, choice].sum() <= budget + 1e-9 and np.all(np.isfinite(cost[rows, choice]))
            assert best - 1e-9 <= got <= best + lam * (budget - lowest) + 1e-9
            exact += bool(np.isclose(got, best))
            total += 1
    assert exact / total > 0.8


def test_marginal_allocation_infeasible():
    bits = np.array([[1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(InfeasibleBudget):
        marginal_allocation(bits, np.ones_like(bits), 1.5)


@pytest.mark.parametrize("mode", [EXLLAMAV3, TENSORFOLD])
def test_rate_rules(small, small_sens, mode):
    plan = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(mode), floor=4))
    check_plan(small, plan)
    for t in targets(small):
        k = plan.k[t.key]
        if t.group in (ATTN, INDEX):
            assert k == int(k) and k >= 4, t.key
        elif t.group in (SHARED, ENGRAM):
            assert k >= 4, t.key
        elif t.group == DRAFT:  # native, or the profile's default where the engine reads it as EXL3 only
            assert k == load_profile(mode).default_drafter_bits
    default = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(mode)))
    assert min(default.k[t.key] for t in targets(small) if t.group in (ATTN, INDEX, SHARED, ENGRAM)) >= DEFAULT_FLOOR
    assert plan.k["head"] == 6.0 and plan.profile.name == mode
    # mcg has no half rates; floor, head and drafter settings are honoured
    mcg_sens = sensitivity(small, synthetic_summary(small, seed=1), "mcg")
    mcg = allocate(small, mcg_sens, 2.9,
                   AllocationSettings(profile=load_profile(EXLLAMAV3), codebook="mcg", floor=3, head_bits=None, drafter_bits=5))
    with pytest.raises(UserError, match="the tensorfold loader takes mul1"):  # its kernels are built for mul1
        allocate(small, mcg_sens, 2.9, AllocationSettings(profile=load_profile(TENSORFOLD), codebook="mcg"))
    assert {k for k in mcg.k.values() if k is not None} <= set(range(1, 9))
    assert mcg.k["head"] is None and mcg.codebook == "mcg" and mcg.k["mtp.0.ffn.experts.0.w1"] == 5.0
    assert min(mcg.k[t.key] for t in targets(small) if t.group in (ATTN, SHARED)) == 3
    drafter_bits = 3.5 if mode == EXLLAMAV3 else 3.0  # tensorfold takes integer K only
    drafted = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(mode), drafter_bits=drafter_bits))
    assert drafted.k["mtp.0.ffn.experts.0.w1"] == drafter_bits and drafted.k["mtp.0.attn.wq_b"] == 3.0
    with pytest.raises(ValueError, match="rates"):
        Allocator(small, small_sens, AllocationSettings(codebook="mcg"))
    with pytest.raises(UserError, match="half rate"):
        Allocator(small, small_sens, AllocationSettings(floor=3.5))


def test_stock_groups_share_k_and_per_expert_profiles_vary(small, small_sens):
    stock = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(EXLLAMAV3)))
    mixed = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(TENSORFOLD)))
    per_group_stock, per_group_mixed = {}, {}
    for t in targets(small):
        if t.group == ROUTED:
            per_group_stock.setdefault((t.layer, t.proj), set()).add(stock.k[t.key])
            per_group_mixed.setdefault((t.layer, t.proj), set()).add(mixed.k[t.key])
    assert all(len(ks) == 1 for ks in per_group_stock.values())
    assert len({next(iter(ks)) for ks in per_group_stock.values()}) > 1  # K differs between layers
    assert any(len(ks) > 1 for ks in per_group_mixed.values())  # per-expert K where a group's budget splits
    # tensorfold takes K per tensor but integer K only, so its cost is not bounded by stock's


@pytest.mark.parametrize("name", ["small-v41.json", "tiny-v41.json"])
@pytest.mark.parametrize("bpw", [2.5, 2.9, 3.5])
def test_budget_and_equal_bytes_against_uniform(name, bpw):
    cfg = ModelConfig.from_file(model_config_path(name))
    sens = sensitivity(cfg, synthetic_summary(cfg))
    uniform = uniform_plan(cfg, bpw)
    for mode in (EXLLAMAV3,):
        plan = allocate(cfg, sens, bpw, AllocationSettings(profile=load_profile(mode)))
        assert bpw - 0.005 <= plan.achieved_bpw <= bpw + 1e-9 and plan.target_bpw == bpw
        # at the bits uniform spends: the same bytes (within 0.2%) at a lower estimated cost
        same = allocate(cfg, sens, uniform.achieved_bpw, AllocationSettings(profile=load_profile(mode)))
        assert abs(budget_bytes(cfg, same) / budget_bytes(cfg, uniform) - 1) < 0.002
        assert plan_cost(sens, same) < plan_cost(sens, uniform)


def test_too_low_budget(small, small_sens):
    with pytest.raises(UserError, match=r"--bpw 1 is too low: .* need \d\.\d+ bpw"):
        allocate(small, small_sens, 1.0)
    with pytest.raises(UserError, match="integer rate"):
        Allocator(small, small_sens, AllocationSettings(floor=16))


def with_cold_experts(summary: CalibrationSummary) -> CalibrationSummary:
    """Experts 3 and 5 of every layer nearly never routed, each with an alias candidate."""
    for layer in summary.layers:
        for cold, warm in ((3, 0), (5, 1)):
            layer.expert_tokens[cold], layer.expert_weight[cold] = 1.0, 0.1
            layer.alias_candidates[cold] = (warm, 0.6)
    return summary


@pytest.mark.parametrize("mode", [EXLLAMAV3, VLLM_EXL3, TENSORFOLD])
def test_aliases_are_refused_with_one_line_and_off_by_default(small, mode):
    """No engine reads an alias map (docs/loader-profiles.md): a plan never leaves an expert out."""
    sens = sensitivity(small, with_cold_experts(synthetic_summary(small, seed=1)))
    assert not allocate(small, sens, 2.9, AllocationSettings(profile=load_profile(mode))).aliases
    with pytest.raises(UserError, match=f"--alias: the {mode} engine reads every expert's own tensors and no engine "
                                        "profile reads an alias map"):
        allocate(small, sens, 2.9, AllocationSettings(profile=load_profile(mode), alias=True))


@pytest.mark.parametrize("mode", [EXLLAMAV3, TENSORFOLD])
def test_recipe_round_trip(small, small_sens, mode, tmp_path):
    plan = allocate(small, small_sens, 2.9, AllocationSettings(profile=load_profile(mode)))
    write_recipe(small, plan, tmp_path / "r.yaml", header="test")
    back = plan_from_recipe(small, read_recipe(tmp_path / "r.yaml"), profile=load_profile(mode))
    assert back.k == plan.k and back.target_bpw == plan.target_bpw
    text = (tmp_path / "r.yaml").read_text()
    if mode == TENSORFOLD:  # per-expert K gives per-expert keys
        assert any(line.strip().startswith("layers.") and ".ffn.experts." in line and "*" not in line
                   for line in text.splitlines())
    else:
        assert all("*" in line.split(":")[0] or ".ffn.experts." not in line for line in text.splitlines())
