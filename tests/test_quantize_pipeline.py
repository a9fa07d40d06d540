"""The quantize stage's pipeline (prepare the next unit while this one encodes, save behind it) gives the
same bytes as one step after another, keeps its memory bound, and loses no finished work on an error;
the GPU batches cover the wo_a slices; plan and build state the GPU-hours a plan implies."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.targets import ROUTED, targets
from quantizer.pack.card import bits_text
from quantizer.pack.manifest import Manifest
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize import QuantizeSettings, quantize
from quantizer.quantize.encode_hours import EncodeRate, RateTable, estimate, plan_estimate
from quantizer.quantize.linears import work_units
from quantizer.quantize.pipeline import run_pipeline
from quantizer.quantize.results import RESULTS_DIR

# Small linears (the CPU codec is the slow part): two encoded, one only cast to fp16.
KEYS = {"layers.3.ffn.experts.1.w2": 2.5, "layers.3.ffn.experts.2.w2": 2.0, "layers.3.ffn.shared_experts.w1": 16.0}


def _hessians(ck):
    """A different SPD Hessian per stored key, made on demand as the calibration store does."""
    def hessian(key):
        n = next(s for s in pack_spec(ck.config, _plan(ck)).encoded if s.key == key).in_features
        gen = torch.Generator().manual_seed(sum(map(ord, key)))
        x = torch.randn(64, n, generator=gen)
        return x.T @ x, 64
    return hessian


def _plan(ck):
    """A stage test: the quantize stage encodes any K map, so no engine profile's rules are asked of it."""
    return Plan(ck.config.arch, "mul1", load_profile(EXLLAMAV3), {t.key: KEYS.get(t.key) for t in targets(ck.config)})


def test_the_pipelined_stage_writes_the_same_bytes_as_the_sequential_one(tiny_v41, tmp_path):
    depth = 2
    ck = Checkpoint.open(tiny_v41)
    runs = {}
    for d in (0, depth):
        work = tmp_path / f"depth{d}"
        quantize(ck, _plan(ck), work, QuantizeSettings(), _hessians(ck), depth=d)
        runs[d] = {p.name: p.read_bytes() for p in sorted((work / RESULTS_DIR).iterdir())}
    assert len(runs[0]) == 3
    assert runs[0] == runs[depth]


def test_the_stage_says_where_its_encoder_time_went_and_a_rerun_encodes_nothing(tiny_v41, tmp_path):
    """unit_seconds holds every unit this run encoded (the rehearsal splits its projection by them) and no
    more than the stage's time; a rerun on the same work directory encodes, and so times, nothing."""
    ck = Checkpoint.open(tiny_v41)
    first = quantize(ck, _plan(ck), tmp_path, QuantizeSettings(), _hessians(ck))
    names = [u.name for u in work_units(pack_spec(ck.config, _plan(ck)).encoded, "cpu")]
    assert sorted(first.unit_seconds) == sorted(names) and len(names) == 3
    assert all(s >= 0 for s in first.unit_seconds.values())
    assert sum(first.unit_seconds.values()) <= first.seconds
    again = quantize(ck, _plan(ck), tmp_path, QuantizeSettings(), _hessians(ck))
    assert again.unit_seconds == {} and again.resumed_units == 3


def test_units_come_out_in_order_with_at_most_depth_prepared_ahead():
    outstanding, peak, lock = [0], [0], threading.Lock()

    def prepare(u):
        with lock:
            outstanding[0] += 1
            peak[0] = max(peak[0], outstanding[0])
        return u * 10

    def encode(u, p):
        with lock:
            outstanding[0] -= 1
        return p + 1

    saved = []
    done = list(run_pipeline(range(20), prepare, encode, lambda u, e: saved.append((u, e)), depth=2))
    assert done == list(range(20))
    assert saved == [(u, u * 10 + 1) for u in range(20)]
    assert peak[0] <= 3  # the one being prepared and two waiting


def test_a_failing_read_stops_the_pipeline_after_saving_what_was_encoded():
    def prepare(u):
        if u == 3:
            raise OSError("disk gone")
        return u

    saved = []
    with pytest.raises(OSError, match="disk gone"):
        list(run_pipeline(range(10), prepare, lambda u, p: p, lambda u, e: saved.append(u)))
    assert saved == [0, 1, 2]


def test_a_failing_save_is_raised_and_nothing_more_is_encoded():
    encoded = []

    def save(u, e):
        if u == 1:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        list(run_pipeline(range(50), lambda u: u, lambda u, p: encoded.append(u), save))
    assert len(encoded) < 50


def test_gpu_units_batch_the_wo_a_slices_of_a_layer(tiny_v41):
    cfg = Checkpoint.open(tiny_v41).config
    cuda = work_units(pack_spec(cfg, uniform_plan(cfg, 2.5)).encoded, "cuda")
    wo_a = [u for u in cuda if u.name.startswith("layers.2.attn.wo_a.")]
    assert [u.keys for u in wo_a] == [tuple(f"layers.2.attn.wo_a.slice.{g}" for g in range(cfg.o_groups))]


# The full-width rehearsal's quantize stage with ours (bench/rehearsal.py --layers 1 --experts 32 --bpw 2.9,
# H100, 2026-12-06, docs/measurements.md): the K its allocator gave each kind of linear (as its direct rates
# name them; the drafter in source form) and the RAM peak it measured
REHEARSAL_KS = {r"\.head$|^head$": 6, r"compressor\.wgate": 4, r"compressor\.wkv": 4, r"indexer\.wk$": 8,
                r"indexer\.wq_b": 4, r"attn\.wkv": 4, r"wo_a": 3, r"wo_b": 2, r"wq_a": 4, r"attn\.wq_b": 3,
                r"engram\.wkv": 4, r"experts\.\d+\.w1": 2.5, r"experts\.\d+\.w2": 3, r"experts\.\d+\.w3": 2.5,
                r"shared_experts\.w1": 6, r"shared_experts\.w2": 6, r"shared_experts\.w3": 5}
REHEARSAL_RAM_PEAK = 6_744_674_304
REHEARSAL_GPU_PEAK = 23_836_439_040  # the same run's (61b2ded, 2026-12-06, the night's rehearsal)


def _rehearsal_units():
    """The rehearsal's slice and plan, recomputed (the same 117 linears in 17 units, 2,124,218,368 weights)."""
    import runpy
    from pathlib import Path

    from quantizer.checkpoint.config import ModelConfig

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "calibrate_memory.py"))
    cfg = ModelConfig.from_dict(bench["slice_config"](1, 32, 1))

    def k(key: str) -> float | None:
        hits = [K for pattern, K in REHEARSAL_KS.items() if re.search(pattern, key)]
        return None if key.startswith("mtp.") or not hits else float(hits[0])

    spec = pack_spec(cfg, Plan(cfg.arch, "mul1", load_profile(EXLLAMAV3), {t.key: k(t.key) for t in targets(cfg)}))
    units = work_units(spec.encoded, "cuda")
    assert (len(spec.encoded), len(units), sum(s.numel for s in spec.encoded)) == (117, 17, 2_124_218_368)
    return units, {s.key: s for s in spec.encoded}


def test_our_ram_estimate_is_within_a_quarter_of_the_rehearsal_it_was_measured_on():
    """The stage's statement for the rehearsal's slice and plan against the peak that run measured: within 25%
    (0.93), where the model that run printed, the largest unit's Hessians for each unit in the window, stated
    1.31 times it."""
    from quantizer.quantize.pipeline import PREFETCH_UNITS
    from quantizer.quantize.stage import quantize_ram

    units, by_key = _rehearsal_units()
    stated = quantize_ram(units, by_key, PREFETCH_UNITS, "cuda", True, "ours")
    assert 0.75 <= stated / REHEARSAL_RAM_PEAK <= 1.25, stated / REHEARSAL_RAM_PEAK


def test_our_gpu_memory_estimate_is_within_a_quarter_of_the_rehearsal_and_grows_with_the_batch(real_v41):
    """The GPU memory the stage states for the rehearsal's slice against that run's peak: within 25%; on the
    real model the largest unit is a full batch of experts, each with its own Hessian (gate2)."""
    from quantizer.quantize.linears import GPU_BATCH_BYTES
    from quantizer.quantize.pipeline import PREFETCH_UNITS
    from quantizer.quantize.stage import KERNEL_SCRATCH, quantize_gpu_memory

    units, by_key = _rehearsal_units()
    stated = quantize_gpu_memory(units, by_key, PREFETCH_UNITS, True)
    assert 0.75 <= stated / REHEARSAL_GPU_PEAK <= 1.25, stated / REHEARSAL_GPU_PEAK
    assert quantize_gpu_memory(units, by_key, 0, True) < stated < quantize_gpu_memory(units, by_key, 2, True)

    spec = pack_spec(real_v41, uniform_plan(real_v41, 2.9))
    real_by_key = {s.key: s for s in spec.encoded}
    real = work_units(spec.encoded, "cuda")
    w1 = next(u for u in real if u.name.endswith(".w1.K3.batch0") and u.name.startswith("layers."))
    members = [real_by_key[k] for k in w1.keys]
    assert len(members) == GPU_BATCH_BYTES // (4 * members[0].numel)
    one = quantize_gpu_memory([w1], real_by_key, 0, True) - KERNEL_SCRATCH
    assert one == 22 * w1.weights + 3 * 4 * 5120**2 * len(members)  # 22 bytes a weight, three copies of each H
    assert quantize_gpu_memory(real, real_by_key, PREFETCH_UNITS, True) > 2 * stated


def test_our_encoder_states_the_host_ram_it_keeps(real_v41):
    """On CUDA exllamav3's batch keeps 4 bytes per weight and the Hessians on the host per unit; ours only the
    Hessians and the original of a tensor above 5e7 weights (the head), and an uncalibrated (drafter) unit
    goes to exllamav3's batch, so it is priced as exllamav3's."""
    from quantizer.quantize.stage import BASE_RAM_CUDA, quantize_ram

    # every target at K 3, the drafter too (no engine loads such a plan: made without a profile's checks)
    spec = pack_spec(real_v41, Plan(real_v41.arch, "mul1", load_profile(EXLLAMAV3), {t.key: 3.0 for t in targets(real_v41)}))
    by_key = {s.key: s for s in spec.encoded}
    units = work_units(spec.encoded, "cuda")

    def ram(unit, encoder):
        return quantize_ram([unit], by_key, 0, "cuda", True, encoder) - BASE_RAM_CUDA

    routed = next(u for u in units if by_key[u.keys[0]].target.group == ROUTED and "mtp" not in u.name)
    members = [by_key[k] for k in routed.keys]
    weights = sum(s.numel for s in members)
    assert ram(routed, "exllamav3") - ram(routed, "ours") == 4 * weights
    # gate2: one H per expert for its w1 and w3
    assert ram(routed, "ours") == sum(4 * s.in_features**2 for s in members if s.in_features == 5120)
    head = next(u for u in units if "head" in u.name)
    assert ram(head, "ours") == 4 * 5120**2 + 4 * sum(by_key[k].numel for k in head.keys)
    drafter = next(u for u in units if "mtp" in u.name)
    assert ram(drafter, "ours") == ram(drafter, "exllamav3") > 0
    assert quantize_ram(units, by_key, 2, "cuda", True) == quantize_ram(units, by_key, 2, "cuda", True, "ours")
    # ours: the unit encoding and the next `depth` units' Hessians, never more than exllamav3's model states
    one, two = (quantize_ram(units, by_key, d, "cuda", True, "ours") for d in (1, 2))
    assert BASE_RAM_CUDA < one < two <= quantize_ram(units, by_key, 2, "cuda", True, "exllamav3")


def test_gpu_hours_follow_the_measured_rate_of_each_k(real_v41_uniform_spec):
    table = RateTable("test GPU", (EncodeRate(2.0, 5120, 2304, 20e6), EncodeRate(2.5, 5120, 2304, 10e6)))
    linears = [s for s in real_v41_uniform_spec(2.5).encoded if s.target.group == ROUTED]
    at = {k: estimate([s for s in linears if s.K == k], table) for k in {s.K for s in linears}}
    for k, e in at.items():
        assert e.seconds == pytest.approx(e.weights / (20e6 if k == 2 else 10e6))
    three = estimate([s._replace(K=3.0) for s in linears[:10]], table)
    assert three.unmeasured == (3.0,) and "K 3 at the nearest measured K's rate" in three.line()


def test_a_plan_of_minutes_reads_under_a_tenth_of_a_gpu_hour(real_v41_uniform_spec):
    table = RateTable("test GPU", (EncodeRate(2.0, 5120, 2304, 20e6),))
    linears = [s._replace(K=2.0) for s in real_v41_uniform_spec(2.5).encoded if s.target.group == ROUTED][:3]
    e = estimate(linears, table)
    assert e.line() == f"quantize: {e.weights:,} weights, under 0.1 GPU-hours on test GPU at measured rates"


def test_the_shipped_table_prices_the_real_model_in_gpu_hours(real_v41, real_v41_uniform):
    e = plan_estimate(real_v41, real_v41_uniform(2.9))  # the default encoder's table: ours
    assert e.encoder == "ours" and e.weights > 543e9 and 2 < e.gpu_hours < 30
    assert e.line().startswith(f"quantize: {e.weights / 1e9:,.1f} G weights, ~")
    assert f"GPU-hours on {e.device.removeprefix('NVIDIA ')} at measured rates" in e.line()


def test_a_table_prices_the_k_it_lacks_at_its_fallbacks_rate_and_says_so(real_v41_uniform_spec):
    theirs = RateTable("test GPU", (EncodeRate(2.0, 5120, 2304, 10e6), EncodeRate(2.5, 5120, 2304, 8e6)))
    ours = RateTable("test GPU", (EncodeRate(2.0, 5120, 2304, 25e6),), "ours", theirs)
    assert ours.rate(2.0, 5120) == (25e6, "measured")
    assert ours.rate(2.5, 5120) == (8e6, "fallback")  # not the integer neighbour's 25e6
    assert ours.rate(3.0, 5120) == (25e6, "nearest")  # neither table has it
    routed = [s for s in real_v41_uniform_spec(2.5).encoded if s.target.group == ROUTED][:4]
    e = estimate([routed[0]._replace(K=2.0), routed[1]._replace(K=2.5), routed[2]._replace(K=3.0)], ours)
    n = routed[0].numel
    assert e.seconds == pytest.approx(n / 25e6 + n / 8e6 + n / 25e6)
    assert e.line().endswith("at measured rates (K 2.5 at exllamav3's own rates, not yet measured with it; K 3 at "
                             "the nearest measured K's rate)")  # ours is the default: no --encoder note


def test_the_shipped_tables_price_our_encoder_below_exllamav3s(real_v41, real_v41_uniform):
    plan = real_v41_uniform(2.9)
    ours, theirs = plan_estimate(real_v41, plan), plan_estimate(real_v41, plan, RateTable.load(encoder="exllamav3"))
    assert ours.weights == theirs.weights and ours.gpu_hours < 0.5 * theirs.gpu_hours
    # every K of the plan (2.5, 3, 4, 6) measured with ours, the half rate too
    assert ours.fallback == () and ours.unmeasured == () and "(" not in ours.line()
    assert theirs.line().endswith("at measured rates (--encoder exllamav3)")
    with pytest.raises(UserError, match="not a readable encode-rate table"):
        RateTable.load(encoder="nonesuch")


@pytest.mark.parametrize("text, says", [
    ('{"format": "quantizer-encode-rates", "device": "X", "rates": [{"K": 2', "not a readable encode-rate table"),
    ('{"format": "quantizer-encode-rates", "device": "X", "fallback": "ours", "rates": '
     '[{"K": 2, "in_features": 5120, "out_features": 2304, "weights_per_s": 1e7}]}', "only to exllamav3's"),
    ('{"format": "quantizer-encode-rates", "device": "X", "rates": '
     '[{"K": 2, "in_features": 5120, "out_features": 2304, "weights_per_s": 0}]}', "with positive rates"),
])
def test_a_bad_rate_table_is_refused_in_one_line(tmp_path, monkeypatch, text, says):
    """A truncated table, one that falls back to itself (or to anything but exllamav3's), a zero rate."""
    import quantizer.quantize.encode_hours as encode_hours

    (tmp_path / "encode_rates").mkdir()
    (tmp_path / "encode_rates" / "ours.json").write_text(text)
    monkeypatch.setattr(encode_hours, "shipped", lambda folder, *parts: tmp_path.joinpath(*parts))
    with pytest.raises(UserError, match=says) as e:
        RateTable.load(encoder="ours")
    assert "\n" not in str(e.value)


def test_plan_states_the_gpu_hours_of_its_plan(capsys):
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.9", "--loader", "exllamav3"]) == 0
    out = capsys.readouterr().out
    ours, theirs = (RateTable.load(encoder=e).device.removeprefix("NVIDIA ") for e in ("ours", "exllamav3"))
    lines = [line for line in out.splitlines() if line.startswith("quantize: ")]
    assert len(lines) == 2  # the default encoder's (ours), then exllamav3's, each on the GPU its table was measured on
    assert re.fullmatch(rf"quantize: 55\d\.\d G weights, ~\d+\.\d GPU-hours on {ours} at measured rates", lines[0])
    assert re.fullmatch(rf"quantize: 55\d\.\d G weights, ~\d+\.\d GPU-hours on {theirs} at measured rates "
                        r"\(--encoder exllamav3\)", lines[1])


def test_a_cpu_build_states_its_plans_encoding_without_a_gpu_figure_before_quantizing(tiny_v41, tmp_path, capsys):
    ck = Checkpoint.open(tiny_v41)
    plan = make_plan(ck.config, {t.key: (16.0 if t.key == "layers.0.attn.wq_a" else None) for t in targets(ck.config)})
    plan.save(tmp_path / "plan.json")
    args = ["build", str(tiny_v41), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "pack"),
            "--no-calibrate"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    m = Manifest.load(tmp_path / "pack")
    assert f"GiB); {bits_text(m)}; head in source form\n" in out and ", bpw " not in out  # the summary's bits in words
    assert "plan: the plan file given; saved as" in out
    line = plan_estimate(ck.config, plan).line("cpu")  # a CPU build: no GPU figure, no CPU rate measured
    assert line in err and err.index(line) < err.index("quantize: 1 linears")
    gpu = RateTable.load().device.removeprefix("NVIDIA ")
    assert line.endswith(f"weights go to quantizer's codec on the CPU; no time estimate (encode rates are "
                         f"measured on {gpu} GPUs only)") and "GPU-hours" not in err
