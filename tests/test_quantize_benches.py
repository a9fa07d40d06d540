"""The quantize benches' arithmetic on the CPU (bench/rehearsal.py's projection of the real model's quantize
time from a slice, bench/quantize_gpu_memory.py's statements): they run on the GPU machine only after a
slice was built, so they must not first break there."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import script_module

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.pack_spec import pack_spec
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize.encode_hours import plan_estimate
from quantizer.quantize.linears import work_units

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rehearsal.py"
MEMORY_BENCH = BENCH.with_name("quantize_gpu_memory.py")
SLICE_NATIVE_BYTES = 5 << 30
# The GPU peak bench/quantize_gpu_memory.py --k 3 measured (two H100s, 2026-12-07; docs/measurements.md)
FULL_BATCH_GPU_PEAK = 59_076_222_464


@pytest.fixture(scope="module")
def bench():
    with script_module(BENCH) as module:
        yield module


def _slice_linears(bench):
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


def test_slow_small_linears_on_the_slice_barely_move_the_real_models_hours(bench, real_v41, real_v41_uniform,
                                                                           real_v41_uniform_spec):
    """The slice's rest (half its weights) at 3x its stated time lifts the real model by its own rest (about
    1% of the weights) at 3x, not by the slice's whole-stage ratio; the experts' ratio carries over whole;
    the time outside any unit scales by the source's size; the classes cover every unit `plan` prices."""
    linears = _slice_linears(bench)
    seconds = _seconds(bench, linears, {"routed experts": 1.25, "the rest": 3.0})
    slow = bench.quantize_by_class(bench.unit_times(linears, seconds), stage_s=sum(seconds.values()) + 2.0)
    assert slow["outside_units_s"] == pytest.approx(2.0)
    assert sum(slow["measured"].values()) / sum(slow["stated"].values()) > 1.8  # the whole-stage ratio
    source_bytes = bench.native_bytes(real_v41)
    real = bench.real_quantize(real_v41_uniform_spec(2.9).encoded, source_bytes, slow, SLICE_NATIVE_BYTES)
    parts = real["by_class_s"]
    assert parts["routed experts"]["projected"] == pytest.approx(1.25 * parts["routed experts"]["stated"])
    assert parts["the rest"]["projected"] == pytest.approx(3.0 * parts["the rest"]["stated"])
    assert parts["the rest"]["stated"] < 0.02 * parts["routed experts"]["stated"]
    assert real["outside_units_s"] == pytest.approx(2.0 * source_bytes / SLICE_NATIVE_BYTES)
    assert real["seconds"] == pytest.approx(sum(p["projected"] for p in parts.values()) + real["outside_units_s"])
    stated = plan_estimate(real_v41, real_v41_uniform(2.9)).seconds
    assert sum(p["stated"] for p in parts.values()) == pytest.approx(stated)
    assert real["seconds"] < 1.4 * stated


def test_a_slice_at_its_stated_rates_projects_what_plan_states(bench, real_v41, real_v41_uniform, real_v41_uniform_spec):
    linears = _slice_linears(bench)
    seconds = _seconds(bench, linears, dict.fromkeys(bench.CLASSES, 1.0))
    by_class = bench.quantize_by_class(bench.unit_times(linears, seconds), stage_s=sum(seconds.values()))
    assert by_class["measured"] == pytest.approx(by_class["stated"])
    assert by_class["outside_units_s"] == pytest.approx(0.0, abs=1e-9)
    real = bench.real_quantize(real_v41_uniform_spec(2.9).encoded, bench.native_bytes(real_v41), by_class,
                               SLICE_NATIVE_BYTES)
    assert real["seconds"] == pytest.approx(plan_estimate(real_v41, real_v41_uniform(2.9)).seconds)


def test_the_rehearsal_lists_each_unit_with_its_statement_and_its_time(bench):
    """The per-unit rows the JSON report keeps (for fitting a per-unit price) add up to the class table, and a
    unit the stage did not time is an error, not a silent gap."""
    linears = _slice_linears(bench)
    seconds = _seconds(bench, linears, {"routed experts": 0.9, "the rest": 2.0})
    rows = bench.unit_times(linears, seconds)
    assert [r["unit"] for r in rows] == [u.name for u in work_units(linears, "cuda")]
    assert {r["measured_s"] for r in rows if r["class"] == "routed experts"} != {0.0}
    by_class = bench.quantize_by_class(rows, stage_s=sum(seconds.values()))
    stated = bench.stated_by_class(linears)  # linear by linear, as `build` states them
    for c in bench.CLASSES:
        assert sum(r["stated_s"] for r in rows if r["class"] == c) == pytest.approx(stated[c])
        assert by_class["stated"][c] == pytest.approx(stated[c])
        assert sum(r["measured_s"] for r in rows if r["class"] == c) == pytest.approx(by_class["measured"][c])
    experts = [r for r in rows if r["class"] == "routed experts"]
    assert all(r["linears"] == 32 and r["measured_s"] == pytest.approx(0.9 * r["stated_s"]) for r in experts)
    del seconds[rows[0]["unit"]]
    with pytest.raises(KeyError):
        bench.unit_times(linears, seconds)


def test_the_memory_bench_states_one_full_batch_as_the_real_models_largest_unit(real_v41_uniform_spec):
    """Its slice's w1 plan is one unit of a full batch of experts, stated as the real model's own w1 units are."""
    from quantizer.quantize.pipeline import PREFETCH_UNITS
    from quantizer.quantize.stage import quantize_gpu_memory

    with script_module(MEMORY_BENCH) as memory:
        cfg = ModelConfig.from_dict(memory.slice_config(1, memory.FULL_BATCH))
        stated = memory.statements(cfg, memory.batch_plan(cfg, 3.0))
    assert stated["units"] == ["layers.0.ffn.experts.w1.K3.batch0"]
    assert stated["weights"] == memory.FULL_BATCH * 5120 * 2304
    spec = real_v41_uniform_spec(2.9)
    by_key = {s.key: s for s in spec.encoded}
    w1 = next(u for u in work_units(spec.encoded, "cuda") if u.name == "layers.0.ffn.experts.w1.K3.batch0")
    assert len(w1.keys) == memory.FULL_BATCH
    assert stated["gpu_memory"] == quantize_gpu_memory([w1], by_key, PREFETCH_UNITS, True)
    assert 0.75 <= stated["gpu_memory"] / FULL_BATCH_GPU_PEAK <= 1.25



@pytest.mark.parametrize("argv, out, says", [
    (["--k", "7"], None, "--k 7: our kernel covers K 1, 2, 3, 4, 5, 6, 1.5, 2.5, 3.5"),
    (["--k", "3"], "file", "is not a directory: the report goes there"),
])
def test_the_memory_bench_refuses_what_it_cannot_measure_before_any_work(tmp_path, monkeypatch, capsys, argv, out, says):
    if out:
        (tmp_path / "OUT").write_text("")
        monkeypatch.setenv("OUT", str(tmp_path / "OUT"))
    with script_module(MEMORY_BENCH) as memory, pytest.raises(SystemExit) as exit_:
        memory.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1]
    assert list(tmp_path.iterdir()) == ([tmp_path / "OUT"] if out else [])
