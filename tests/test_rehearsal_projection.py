"""bench/rehearsal.py's projection of the real model's quantize time from a slice, on the CPU: it runs on the
GPU machine only after a slice was built, so its arithmetic must not first break there."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import script_module

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.pack_spec import pack_spec
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize.encode_hours import plan_estimate
from quantizer.quantize.linears import work_units
from quantizer.shipped import model_config_path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rehearsal.py"
RUN = {"native_bytes": 5 << 30, "full_layer": {"seconds": 80.0, "cols": 2048},
       "stages": {"pack": {"seconds": 8.0}, "verify": {"seconds": 0.2}}, "pack_bytes": 4 << 30}


@pytest.fixture(scope="module")
def bench():
    with script_module(BENCH) as module:
        yield module


@pytest.fixture(scope="module")
def slice_linears(bench):
    cfg = ModelConfig.from_dict(bench.slice_config(1, 32))
    return pack_spec(cfg, uniform_plan(cfg, 2.9)).encoded


def _seconds(bench, linears, per_class: dict[str, float]) -> dict[str, float]:
    """unit_seconds where every unit of a class took `per_class[class]` times what the table states for it."""
    by_key = {s.key: s for s in linears}
    out = {}
    for u in work_units(linears, "cuda"):
        members = [by_key[k] for k in u.keys]
        out[u.name] = bench.stated_by_class(members)[bench.unit_class(members)] * per_class[bench.unit_class(members)]
    return out


def test_slow_small_linears_on_the_slice_barely_move_the_real_models_hours(bench, slice_linears):
    """The slice's rest (half its weights) at 3x its stated time lifts the real model by what its own rest
    (about 1% of the weights) states, twice over, not by the slice's whole-stage ratio; the experts' ratio
    carries over whole; time outside any unit scales by the source's size."""
    slow = bench.quantize_by_class(slice_linears, _seconds(bench, slice_linears, {"routed experts": 1.25, "the rest": 3.0}),
                                   stage_s=0.0)
    slow["outside_units_s"] = 2.0
    real = bench.real_needs(2.9, slow, RUN)
    parts = real["quantize_by_class_h"]
    assert parts["routed experts"]["projected"] == pytest.approx(1.25 * parts["routed experts"]["stated"])
    assert parts["the rest"]["projected"] == pytest.approx(3.0 * parts["the rest"]["stated"])
    assert parts["the rest"]["stated"] < 0.02 * parts["routed experts"]["stated"]
    cfg = ModelConfig.from_file(model_config_path(bench.REAL))
    outside_h = 2.0 * bench.real_source_bytes(cfg) / RUN["native_bytes"] / 3600
    assert real["quantize_outside_units_h"] == pytest.approx(outside_h)
    whole = sum(slow["measured"].values()) / sum(slow["stated"].values())
    assert whole > 1.8
    assert real["quantize_h_1gpu"] == pytest.approx(
        sum(p["projected"] for p in parts.values()) + outside_h)
    stated_h = plan_estimate(cfg, uniform_plan(cfg, 2.9)).gpu_hours
    assert sum(p["stated"] for p in parts.values()) == pytest.approx(stated_h)  # the classes cover every unit
    assert real["quantize_h_1gpu"] < 1.4 * stated_h


def test_the_stages_time_outside_its_units_is_kept_apart(bench, slice_linears):
    seconds = _seconds(bench, slice_linears, dict.fromkeys(bench.CLASSES, 1.0))
    by_class = bench.quantize_by_class(slice_linears, seconds, stage_s=sum(seconds.values()) + 5.0)
    assert by_class["outside_units_s"] == pytest.approx(5.0)
    assert by_class["measured"] == pytest.approx(by_class["stated"])
