"""The plan that fits a number of Sparks: `plan` and `build` choose theirs with `choose_plan`.

The planner is passed in (bpw -> Plan, any method); the search over bpw is fit's own
(memory.highest_fitting_bpw), the same one `quantizer fit --bpw` uses to say what would fit. On an engine
that serves weights from the mapped file, a `cold_share` above 0 lets the least-routed experts stay in the
page cache where that makes a plan fit (cold_experts.py); the launch settings that say so come back with
the plan, and so does whether the engine runs the drafter (not where it would have to dequantize a
source-form drafter into GPU memory: launch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.fit.cold_experts import place_cold_experts
from quantizer.fit.decode import decode_cost
from quantizer.fit.hardware import Hardware, load_hardware
from quantizer.fit.launch import Launch, launch_context
from quantizer.fit.memory import FitOptions, FitReport, FitTarget, Scenario, fit, highest_fitting_bpw, lowest_accepted
from quantizer.fit.stored import StoredTensor
from quantizer.model.targets import DRAFT, targets


@dataclass(frozen=True)
class FittedPlan:
    plan: Plan
    report: FitReport
    launch: Launch  # which experts stay in the page cache (none where the engine copies every weight)


def choose_plan(cfg: ModelConfig, plan_at: Callable[[float], Plan] | None, lowest: float, highest: float,
                target: FitTarget | None, bpw: float | None = None, given: Plan | None = None,
                hardware: Hardware | None = None, tokens: dict[str, float] | None = None
                ) -> tuple[Plan, FittedPlan | None]:
    """The plan `plan` and `build` make: `given`, or the one at `bpw`, fitted to `target` where one is given;
    else the largest plan in [lowest, highest] bpw that fits `target`."""
    if given is not None or bpw is not None:
        plan = given or plan_at(bpw)
        return plan, fit_plan(cfg, plan, target, tokens, hardware) if target else None
    fitted = largest_fitting_plan(cfg, plan_at, lowest, highest, target, hardware, tokens)
    return fitted.plan, fitted


def fit_plan(cfg: ModelConfig, plan: Plan, target: FitTarget, tokens: dict[str, float] | None = None,
             hardware: Hardware | None = None) -> FittedPlan:
    """The fit of one plan on the target, with its cold experts placed."""
    hw = hardware or load_hardware()
    stored = pack_spec(cfg, plan).tensors
    s, launch = place_cold_experts(cfg, stored, target.scenario(hw, runs_drafter(cfg, plan, target.engine, hw)), hw,
                                   tokens or {}, target.cold_share, margin_gib=target.margin_gib)
    report = fit(cfg, stored, target, FitOptions(drafter=s.drafter, copy_pattern=s.copy_pattern), hardware=hw,
                 source=plan.made_by, loader=plan.profile.name)
    report.decode = decode_cost(cfg, plan, list(stored), plan.profile, target.sparks, hw, target.context,
                                report.drafter != "off", routing_of(tokens))
    return FittedPlan(plan, report, launch)


def routing_of(tokens: dict[str, float] | None) -> dict[int, list[float]] | None:
    """Calibration's routed tokens per expert (`layers.L.ffn.experts.E` -> n) as layer -> tokens by expert."""
    if not tokens:
        return None
    out: dict[int, dict[int, float]] = {}
    for key, n in tokens.items():
        parts = key.split(".")
        out.setdefault(int(parts[1]), {})[int(parts[4])] = n
    return {layer: [by[e] for e in sorted(by)] for layer, by in out.items()}


def largest_launch(cfg: ModelConfig, plan: Plan, hardware: Hardware | None = None) -> Launch:
    """The launch settings of a pack built without a fit target, where its engine serves weights from the
    mapped file (one Spark): every expert copied, at the largest context that fits the engine's Spark count
    (the launcher's own default where none does). Launch() for an engine that maps nothing."""
    hw = hardware or load_hardware()
    if hw.engine(plan.profile.fit_engine).mapped is None:
        return Launch()
    target = FitTarget(plan.profile.sparks[0], cfg.max_position_embeddings, engine=plan.profile.fit_engine)
    fitted = fit_plan(cfg, plan, target, hardware=hw)
    largest = fitted.report.max_context
    return replace(fitted.launch, context=launch_context(largest) if largest else None)


def runs_drafter(cfg: ModelConfig, plan: Plan, engine: str | None, hw: Hardware) -> bool:
    """Whether the engine runs the plan's drafter: not where it serves weights from the mapped file and the
    plan leaves the drafter in source form (dequantized, it would be copied whole into GPU memory)."""
    return hw.engine(engine or hw.default_engine).mapped is None or drafter_in_exl3(cfg, plan)


def drafter_in_exl3(cfg: ModelConfig, plan: Plan) -> bool:
    """Whether every linear of the plan's drafter is EXL3 (True for a model without one)."""
    return all(plan.k[t.key] is not None for t in targets(cfg) if t.group == DRAFT)


def largest_fitting_plan(cfg: ModelConfig, plan_at: Callable[[float], Plan], lo: float, hi: float,
                         target: FitTarget, hardware: Hardware | None = None,
                         tokens: dict[str, float] | None = None) -> FittedPlan:
    """The plan at the largest bpw in [lo, hi] that fits `target`, with its fit report.

    `plan_at` may raise UserError below its own lowest rate. UserError when even the lowest plan it
    accepts does not fit, with the shortfall."""
    hw = hardware or load_hardware()
    target.scenario(hw)  # the topology is checked before any plan is made
    plans: dict[float, Plan] = {}
    stored: dict[str, list[StoredTensor]] = {}

    def plan(bpw: float) -> Plan:
        if bpw not in plans:
            plans[bpw] = plan_at(bpw)
        return plans[bpw]

    def stored_at(bpw: float) -> list[StoredTensor]:
        """One list per distinct pack: coarse layouts give the same plan at nearby bpw, evaluated once."""
        key = plan(bpw).content_hash()
        if key not in stored:
            stored[key] = pack_spec(cfg, plan(bpw)).tensors
        return stored[key]

    def placed(bpw: float) -> Scenario:
        s = target.scenario(hw, runs_drafter(cfg, plan(bpw), target.engine, hw))
        return place_cold_experts(cfg, stored_at(bpw), s, hw, tokens or {}, target.cold_share, fill=True)[0]

    scenario = target.scenario(hw)
    found = highest_fitting_bpw(cfg, stored_at, lowest_accepted(plan, lo, hi), hi, scenario, hw, placed,
                                target.margin_gib)
    if not found.fits:
        margin = f" (keeping the {target.margin_gib:g} GiB margin, --margin)" if target.margin_gib else ""
        raise UserError(f"does not fit {target.describe()} ({scenario.engine}) even at the lowest rates "
                        f"({plans[found.bpw].achieved_bpw:.3f} bpw): the worst rank is short by "
                        f"{-found.free_gib:.2f} GiB{margin}; use more Sparks, a shorter --context or fewer --streams")
    return fit_plan(cfg, plans[found.bpw], target, tokens, hw)
