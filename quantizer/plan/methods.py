"""The three ways to choose K: ours (allocate.py), uniform (uniform.py), exl3 (exllamav3's allocator).

`planner` turns a method into `bpw -> Plan` plus the lowest bpw worth asking for, the form both a
plan at a given bpw and fit's search for the most bits that fit N Sparks (fit/target.py) take;
`quantizer plan` and `quantizer build` share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import rate_grid
from quantizer.plan.allocate import AllocationSettings, Allocator, alias_refusal
from quantizer.plan.exl3_baseline import HQ, exl3_plan
from quantizer.plan.sensitivity import sensitivity
from quantizer.plan.uniform import lowest_uniform_bpw, uniform_plan

OURS, UNIFORM, EXL3 = "ours", "uniform", "exl3"
METHODS = (OURS, UNIFORM, EXL3)


def planner(cfg: ModelConfig, method: str, settings: AllocationSettings | None = None,
            summary: CalibrationSummary | None = None, floor: float | None = None, hq: int = HQ,
            measured: dict[str, dict[float, float]] | None = None) -> tuple[Callable[[float], Plan], float]:
    """(bpw -> Plan by `method`, the lowest bpw worth trying). `ours` needs a calibration summary
    (measured proxy errors per key and K sharpen it); `floor` None is each method's own floor rule."""
    settings = settings or AllocationSettings()
    lowest = rate_grid(settings.codebook)[0]
    if method not in METHODS:
        raise UserError(f"method {method!r}; choose from {', '.join(METHODS)}")
    if settings.alias and not settings.profile.aliases:
        raise UserError(alias_refusal(settings.profile.name))
    if method != OURS and settings.alias:
        raise UserError(f"--alias applies to --method ours; {method} plans store every expert")
    if method == UNIFORM:
        return (lambda b: uniform_plan(cfg, b, settings.codebook, settings.head_bits, settings.drafter_bits,
                                       floor, settings.profile, settings.overlay, settings.expert_layout,
                                       settings.half_rates)), \
            lowest_uniform_bpw(cfg, settings.codebook, floor, settings.profile, settings.half_rates)
    if method == EXL3:
        if not settings.profile.is_stock:
            raise UserError(f"--method exl3 plans exllamav3's own layout (half rates, every linear of its model); "
                            f"the {settings.profile.name} engine loads another: use --method ours or uniform")
        return (lambda b: exl3_plan(cfg, b, settings.codebook, settings.head_bits, hq, settings.drafter_bits,
                                    settings.profile)), lowest
    if summary is None:
        raise ValueError("planner: the ours method needs a calibration summary")
    if floor is not None:
        settings = replace(settings, floor=floor)
    alloc = Allocator(cfg, sensitivity(cfg, summary, settings.codebook, measured), settings)
    return (lambda b: alloc.plan(b * alloc.total_numel, target_bpw=b)), alloc.min_bits / alloc.total_numel
