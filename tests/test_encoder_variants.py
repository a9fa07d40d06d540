"""bench/encoder_variants.py's logic without a GPU (it must not first break on the GPU machine): kernel names
grouped, the code-equality summary, the timed parts of a call (nested, self time, functions restored), and the
whole measuring loop, its tables and its JSON with a stand-in encoder and a stand-in kernel switch."""

from __future__ import annotations

import contextlib
import json
import os
import types
from pathlib import Path

import pytest
import torch
from script_module import script_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "encoder_variants.py"


class Clock:
    """Stand-in CUDA events: `record` reads the clock (milliseconds), `elapsed_time` subtracts."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()


def fake_quantize_module(clock: Clock, env: str):
    """The functions `quantize_exl3_batch` calls, calling each other through the module as exllamav3's do;
    a Viterbi tile costs 1 ms with the generic kernel and 0.5 ms with the optimized one."""
    mod = types.ModuleType("fake_quantize")

    def quantize_tiles_multigpu(tiles, quant_args):
        clock.now += tiles.shape[0] * (0.5 if os.environ.get(env) == "1" else 1.0)
        return tiles, None

    def g_scale_search_batch(samples, quant_args):
        clock.now += 2
        mod.quantize_tiles_multigpu(samples, quant_args)
        return [(1.0, 0.0)]

    def ldlq_batched(weights, Ls, quant_args, pb=None):
        for _ in range(3):
            clock.now += 1
            mod.quantize_tiles_multigpu(weights, quant_args)
        return weights, None

    mod.quantize_tiles_multigpu, mod.g_scale_search_batch, mod.ldlq_batched = \
        quantize_tiles_multigpu, g_scale_search_batch, ldlq_batched
    return mod


def test_kernels_are_grouped_by_name():
    names = {
        "void quantize_tiles_kernel<2, 2, 256>(float const*, float*, unsigned short*, __half*, unsigned short*, "
        "__half2 const*)": "Viterbi",
        "void quantize_tiles_optimized_kernel<3, 2, 256>(float const*, float*)": "Viterbi",
        "void quantize_tiles_frac_kernel<2, 43690u, 256>(float const*, float*)": "Viterbi",
        "void pack_trellis_kernel<3>(unsigned short*, unsigned short const*)": "pack",
        "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "GEMM",
        "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_cublas": "GEMM",
        "void cusolverDn::potrf_kernel<float>(int, float*, int, int*)": "Cholesky",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": "elementwise",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 128, 1>(float*)": "elementwise",
        "Memcpy HtoD (Pageable -> Device)": "memcpy",
        "some_kernel_nobody_knows": "other",
    }
    with script_module(BENCH) as bench:
        for name, group in names.items():
            assert bench.kernel_group(name).startswith(group), name
        assert bench.short_name("void quantize_tiles_kernel<2, 2, 256>(float const*, float*)") == \
            "quantize_tiles_kernel<2, 2, 256>"
        assert bench.short_name("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 3>(float*)") == \
            "at::native::CatArrayBatchedCopy<float, 3>"
        assert bench.short_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD "
        assert len(bench.short_name("x" * 300)) == 100


def test_kernel_summary_shares_and_busy_time():
    kernels = [("void quantize_tiles_kernel<2, 2, 256>(float const*)", 0.0, 600.0),
               ("void quantize_tiles_kernel<2, 2, 256>(float const*)", 700.0, 1300.0),
               ("nvjet_sm90_tst_gemm", 500.0, 800.0),  # overlaps both on another stream
               ("Memcpy DtoH (Device -> Pageable)", 2000.0, 2100.0)]
    with script_module(BENCH) as bench:
        s = bench.summarize_kernels(kernels, wall_s=0.004)
    assert s["kernels"] == 4
    assert s["kernel_s"] == pytest.approx(1.6e-3)
    assert s["busy_s"] == pytest.approx(1.4e-3)  # 0-1300 and 2000-2100
    groups = {g["group"].split(" ")[0]: g for g in s["groups"]}
    assert groups["Viterbi"]["seconds"] == pytest.approx(1.2e-3) and groups["Viterbi"]["kernels"] == 2
    assert groups["Viterbi"]["share_of_kernel_time"] == pytest.approx(0.75)
    assert groups["Viterbi"]["share_of_wall"] == pytest.approx(0.3)
    assert sum(g["share_of_kernel_time"] for g in s["groups"]) == pytest.approx(1.0)
    assert s["groups"][0]["group"].startswith("Viterbi")  # largest first
    assert s["viterbi_kernels"] == ["quantize_tiles_kernel<2, 2, 256>"]
    assert s["largest_kernels"][0] == {"name": "quantize_tiles_kernel<2, 2, 256>", "seconds": pytest.approx(1.2e-3),
                                       "count": 2}


def result(trellis, proxy=0.1, suh=None):
    return proxy, {"trellis": trellis, "suh": torch.ones(4) if suh is None else suh, "svh": torch.ones(6)}


def test_equal_codes_and_the_count_of_differing_tiles():
    t = torch.arange(5 * 3 * 32, dtype=torch.int16).reshape(5, 3, 32)  # 15 tiles of K 2
    changed = t.clone()
    changed[0, 1, 7] += 1
    changed[4, 2, 0] += 1
    changed[4, 2, 31] += 1  # the same tile again
    with script_module(BENCH) as bench:
        same = bench.compare([result(t), result(t)], [result(t.clone()), result(t.clone())],
                             [{"g_scale": 1.1}] * 2, [{"g_scale": 1.1}] * 2)
        diff = bench.compare([result(t), result(t)], [result(t.clone()), result(changed, 0.1001, -torch.ones(4))],
                             [{"g_scale": 1.1}] * 2, [{"g_scale": 1.1}, {"g_scale": 1.2}])
    assert same["codes_equal"] and same["suh_equal"] and same["svh_equal"] and same["proxy_equal"]
    assert same["g_scale_equal"] and same["differing_tiles"] == 0 and same["tiles"] == 30
    assert not diff["codes_equal"] and diff["differing_tiles"] == 2 and diff["tensors_differing"] == 1
    assert not diff["suh_equal"] and diff["svh_equal"] and not diff["proxy_equal"] and not diff["g_scale_equal"]
    assert diff["proxy_max_rel_diff"] == pytest.approx(1e-3, rel=1e-2)
    assert diff["proxy_mean"] == [pytest.approx(0.1), pytest.approx(0.10005)]


def test_parts_are_nested_spans_with_self_time_and_the_functions_come_back():
    clock = Clock()
    mod = fake_quantize_module(clock, "UNSET_FOR_THIS_TEST")
    originals = dict(vars(mod))
    with script_module(BENCH) as bench:
        with bench.Parts(mod, event=clock.event) as parts:
            mod.g_scale_search_batch(torch.zeros(10, 256), {})
            mod.ldlq_batched(torch.zeros(4, 256), None, {})
            with pytest.raises(AttributeError):
                mod.quantize_tiles_multigpu(None, {})  # raises inside: the span still closes
        rows = {r["part"]: r for r in parts.summary(wall_s=0.030)}
        assert vars(mod) == originals
        assert "finalize_capture_H" in parts.missing
        assert bench.viterbi_seconds(list(rows.values())) == pytest.approx(0.022)
    assert rows["scale search"]["seconds"] == pytest.approx(0.002) and rows["scale search"]["depth"] == 0
    assert rows["scale search / Viterbi"]["seconds"] == pytest.approx(0.010)
    assert rows["scale search / Viterbi"]["tiles"] == 10 and rows["scale search / Viterbi"]["depth"] == 1
    assert rows["LDLQ"]["seconds"] == pytest.approx(0.003) and rows["LDLQ"]["calls"] == 1
    assert rows["LDLQ / Viterbi"]["calls"] == 3 and rows["LDLQ / Viterbi"]["tiles"] == 12
    assert rows["Viterbi"]["calls"] == 1 and rows["Viterbi"]["seconds"] == 0
    other = rows[next(p for p in rows if p.startswith("other"))]
    assert other["seconds"] == pytest.approx(0.030 - 0.027)
    assert other["share_of_wall"] == pytest.approx(0.1)


class FakeProfile:
    """torch.profiler.profile as `profiled` uses it: `fail` names the method that raises; `events` lists
    (name, device type, start_us, end_us, is_user_annotation)."""

    events_ = []
    fail = None

    def __init__(self, activities):
        assert activities == [torch.profiler.ProfilerActivity.CUDA]

    def _maybe_fail(self, method):
        if self.fail == method:
            raise RuntimeError(f"{method} failed")

    def start(self):
        self._maybe_fail("start")

    def stop(self):
        self._maybe_fail("stop")

    def events(self):
        self._maybe_fail("events")
        return [types.SimpleNamespace(name=n, device_type=d, time_range=types.SimpleNamespace(start=a, end=b),
                                      is_user_annotation=u) for n, d, a, b, u in self.events_]


def fake_profiler(monkeypatch, fail=None, events=()):
    monkeypatch.setattr(torch.profiler, "profile", type("P", (FakeProfile,), {"fail": fail, "events_": list(events)}))


def test_profiled_reads_device_kernels_and_survives_a_failing_profiler(monkeypatch):
    from torch.autograd import DeviceType

    events = [("void quantize_tiles_kernel<2, 2, 256>(float const*)", DeviceType.CUDA, 0.0, 600.0, False),
              ("cudaLaunchKernel", DeviceType.CPU, 0.0, 5.0, False),  # the host side of a launch
              ("scale search", DeviceType.CUDA, 0.0, 900.0, True),  # a GPU range, not a kernel
              ("nvjet_sm90_tst_gemm", DeviceType.CUDA, 600.0, 800.0, False)]
    with script_module(BENCH) as bench:
        fake_profiler(monkeypatch, events=events)
        out, prof = bench.profiled(lambda: (0.002, "results", "args"))
        assert out == (0.002, "results", "args")
        assert prof["kernels"] == 2 and prof["kernel_s"] == pytest.approx(8e-4) and prof["wall_s"] == 0.002
        assert prof["viterbi_kernels"] == ["quantize_tiles_kernel<2, 2, 256>"]
        for fail, needle in (("start", "did not start"), ("stop", "did not stop"), ("events", "could not be read")):
            fake_profiler(monkeypatch, fail=fail, events=events)
            out, prof = bench.profiled(lambda: (0.002, "results", "args"))
            assert out == (0.002, "results", "args") and needle in prof["error"] and f"{fail} failed" in prof["error"]
        fake_profiler(monkeypatch)
        assert "no CUDA kernels" in bench.profiled(lambda: (0.002, None, None))[1]["error"]
        fake_profiler(monkeypatch, fail="stop")

        def broken():
            raise ValueError("the call itself")

        with pytest.raises(ValueError, match="the call itself"):  # not taken for a profiler failure
            bench.profiled(broken)


def test_the_measuring_loop_tables_and_json_with_a_stand_in_encoder(monkeypatch, capsys):
    """K 2 and 3 in both variants, K 2.5 on the frac kernel, K 4's optimized run failing: the variants are
    compared where both ran, the failure is recorded and the rest measured, the profiled call (its profiler
    failing to start) is still compared run to run, and the tables print."""
    fake_profiler(monkeypatch, fail="start")
    clock = Clock()
    with script_module(BENCH) as bench:
        env = bench.ENV
        monkeypatch.delenv(env, raising=False)
        mod = fake_quantize_module(clock, env)

        def encode(weights, hessians, K, device):
            start = clock.now
            mod.g_scale_search_batch(torch.zeros(10, 256), {})
            mod.ldlq_batched(torch.zeros(4, 256), None, {})
            clock.now += 1  # outside every part
            optimized = os.environ.get(env) == "1"
            results = []
            for i in range(len(weights)):
                trellis = torch.zeros(4, 3, int(16 * K), dtype=torch.int16)
                if optimized and i == 1:
                    trellis[0, 1, 5] = trellis[2, 2, 0] = 1
                results.append((0.1 + i, {"trellis": trellis, "suh": torch.ones(8), "svh": torch.ones(6)}))
            return (clock.now - start) / 1e3, results, [{"g_scale": 1.0} for _ in weights]

        @contextlib.contextmanager
        def variant(v, K, device):
            if v == "optimized" and K == 4:
                raise RuntimeError("no optimized kernel here")
            monkeypatch.setenv(env, "1" if v == "optimized" else "0")
            yield {} if v == bench.FRAC else {"optimized": v == "optimized", "wave": 132 if v == "optimized" else 264}

        saved = []
        weights, hessians = [torch.zeros(2, 2)] * 3, [(torch.eye(2), 1)] * 3
        report = bench.measure(weights, hessians, [2.0, 2.5, 3.0, 4.0], device=None, profile_ks=[3.0],
                               encode=encode, variant=variant, log=lambda s: None, save=saved.append,
                               parts_factory=lambda: bench.Parts(mod, event=clock.event),
                               variants=("generic", "optimized"))
        report.update(experts=3, shape="w1", device="stand-in")
        bench.print_report(report)
    out = capsys.readouterr().out
    assert len(saved) == 5  # after every K, and after the profiled call
    assert [(r["K"], r["variant"]) for r in report["runs"]] == [
        (2.0, "generic"), (2.0, "optimized"), (2.5, "frac"), (3.0, "generic"), (3.0, "optimized"),
        (4.0, "generic"), (4.0, "optimized")]
    assert report["errors"] == ["K 4 optimized: RuntimeError: no optimized kernel here"]
    assert "error" in report["runs"][-1] and "best_s" in report["runs"][-2]
    assert [c["K"] for c in report["comparisons"]] == [2.0, 3.0]
    c = report["comparisons"][0]
    assert not c["codes_equal"] and c["differing_tiles"] == 2 and c["tiles"] == 36 and c["tensors_differing"] == 1
    assert c["suh_equal"] and c["proxy_equal"] and c["g_scale_equal"]
    generic, optimized = report["runs"][0], report["runs"][1]
    assert generic["best_s"] == pytest.approx(0.028) and optimized["best_s"] == pytest.approx(0.017)
    assert (c["variant"], c["reference"]) == ("optimized", "generic")
    assert c["speed"] == pytest.approx(0.028 / 0.017)
    assert c["viterbi_speed"] == pytest.approx(2.0)
    assert generic["weights_per_s"] == pytest.approx(12 / 0.028)
    assert generic["wave"] == 264 and optimized["optimized"]
    assert {p["part"] for p in generic["parts"]} >= {"scale search / Viterbi", "LDLQ / Viterbi"}
    assert "regularize" in generic["parts_missing"]
    assert report["profiles"][0]["K"] == 3.0 and "did not start" in report["profiles"][0]["error"]
    assert [(r["K"], r["variant"], r["codes_equal"]) for r in report["run_to_run"]] == [(3.0, "generic", True)]
    json.loads(json.dumps(report))
    assert "NO (2 of 36 tiles)" in out and "FAILED" in out and "did not start" in out
    assert "scale search" in out and "Viterbi" in out


def test_without_cuda_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("OUT", raising=False)
    with script_module(BENCH) as bench, pytest.raises(SystemExit) as stop:
        bench.main(["--ks", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("encoder_variants: needs a CUDA device")


def test_a_k_off_the_mul1_grid_is_refused(capsys):
    with script_module(BENCH) as bench, pytest.raises(SystemExit) as stop:
        bench.main(["--ks", "2", "2.25"])
    assert stop.value.code == 2
    assert "--ks 2.25: not a mul1 rate" in capsys.readouterr().err


def test_ours_runs_its_own_convert_and_is_compared_with_generic_and_frac(monkeypatch):
    """The ours variant's context yields the conversion to call; encode gets it (the run's JSON does not), ours is
    compared with generic at integer K and with frac at a half, and its own loop's parts are timed too."""
    clock = Clock()
    with script_module(BENCH) as bench:
        mod = fake_quantize_module(clock, bench.ENV)
        loop = types.ModuleType("fake_loop")

        def _finalize(h):
            clock.now += 3
            return h

        loop._finalize = _finalize
        calls = []

        def our_convert():
            return "ours"

        def encode(weights, hessians, K, device, convert=None):
            calls.append((K, convert))
            start = clock.now
            if convert:
                loop._finalize(None)
            mod.ldlq_batched(torch.zeros(2 if convert else 4, 256), None, {})
            trellis = torch.zeros(2, 2, int(16 * K), dtype=torch.int16)
            return (clock.now - start) / 1e3, [(0.5, {"trellis": trellis, "suh": torch.ones(4),
                                                      "svh": torch.ones(4)})], [{"g_scale": 1.0}]

        @contextlib.contextmanager
        def variant(v, K, device):
            yield {"convert": our_convert} if v == bench.OURS else {}

        report = bench.measure([torch.zeros(2, 2)], [(torch.eye(2), 1)], [2.0, 2.5], device=None, encode=encode,
                               variant=variant, log=lambda s: None, variants=("generic", "ours"),
                               parts_factory=lambda: bench.Parts(mod, event=clock.event,
                                                                 also=[(loop, bench.OUR_PARTS)]))
        assert loop._finalize is _finalize  # restored
    assert [(r["K"], r["variant"]) for r in report["runs"]] == [(2.0, "generic"), (2.0, "ours"), (2.5, "frac"),
                                                                (2.5, "ours")]
    assert [c for _, c in calls] == [None, None, our_convert, our_convert, None, None, our_convert, our_convert]
    assert [(c["K"], c["variant"], c["reference"], c["codes_equal"]) for c in report["comparisons"]] == [
        (2.0, "ours", "generic", True), (2.5, "ours", "frac", True)]
    ours = report["runs"][1]
    assert ours["best_s"] == pytest.approx(0.012) and report["comparisons"][0]["speed"] == pytest.approx(15 / 12)
    assert {p["part"] for p in ours["parts"]} >= {"Hessian: finalize (ours)", "LDLQ / Viterbi"}
    json.loads(json.dumps(report))


def test_variants_for_a_k():
    with script_module(BENCH) as bench:
        assert bench.variants_for(3.0) == ("generic", "optimized", "ours")
        assert bench.variants_for(3.0, ("generic", "ours")) == ("generic", "ours")
        assert bench.variants_for(2.5) == ("frac", "ours")
        assert bench.variants_for(2.5, ("generic",)) == ("frac",)
