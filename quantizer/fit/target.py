"""The largest plan that fits a number of Sparks: `plan --sparks` and `build --sparks` ask this.

The planner is passed in (bpw -> Plan, any method); the search over bpw is fit's own
(memory.highest_fitting_bpw), the same one `quantizer fit --bpw` uses to say what would fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.fit.hardware import Hardware, load_hardware
from quantizer.fit.memory import FitReport, Scenario, fit, highest_fitting_bpw, lowest_accepted
from quantizer.fit.stored import StoredTensor
from quantizer.plan.plan import Plan
from quantizer.plan.spec import pack_spec


@dataclass(frozen=True)
class FitTarget:
    sparks: int
    context: int
    streams: int = 1
    engine: str | None = None

    def describe(self) -> str:
        return (f"{self.sparks} Spark{'s' if self.sparks > 1 else ''} at {self.context:,} tokens x {self.streams} "
                f"stream{'s' if self.streams > 1 else ''}")


def largest_fitting_plan(cfg: ModelConfig, plan_at: Callable[[float], Plan], lo: float, hi: float,
                         target: FitTarget, hardware: Hardware | None = None) -> tuple[Plan, FitReport]:
    """The plan at the largest bpw in [lo, hi] that fits `target`, with its fit report.

    `plan_at` may raise UserError below its own lowest rate. UserError when even the lowest plan it
    accepts does not fit, with the shortfall."""
    hw = hardware or load_hardware()
    scenario = Scenario(target.sparks, target.context, target.streams, target.engine or hw.default_engine)
    plans: dict[float, Plan] = {}
    stored: dict[float, list[StoredTensor]] = {}

    def plan(bpw: float) -> Plan:
        if bpw not in plans:
            plans[bpw] = plan_at(bpw)
        return plans[bpw]

    def stored_at(bpw: float) -> list[StoredTensor]:
        if bpw not in stored:
            stored[bpw] = pack_spec(cfg, plan(bpw)).tensors
        return stored[bpw]

    found = highest_fitting_bpw(cfg, stored_at, lowest_accepted(plan, lo, hi), hi, scenario, hw)
    if not found.fits:
        raise UserError(f"does not fit {target.describe()} ({scenario.engine}) even at the lowest rates "
                        f"({plans[found.bpw].achieved_bpw:.3f} bpw): the worst rank is short by "
                        f"{-found.free_gib:.2f} GiB; use more Sparks, a shorter --context or fewer --streams")
    report = fit(cfg, stored[found.bpw], target.sparks, target.context, target.streams, scenario.engine,
                 hardware=hw, source=plans[found.bpw].made_by)
    return plans[found.bpw], report
