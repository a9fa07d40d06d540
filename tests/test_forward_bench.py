"""The GPU layer benchmarks' logic at tiny shapes (they must not first break on the GPU machine),
and the FLOP count the forward bench reports."""

from __future__ import annotations

import json
from pathlib import Path

from script_module import script_module

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.flops import layer_flops
from quantizer.shipped import model_config_path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "forward_gpu_layer.py"
CALIBRATE_BENCH = BENCH.with_name("calibrate_gpu_layer.py")


def test_gpu_layer_bench_runs_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    with script_module(BENCH) as bench:
        report = bench.main(["--tiny", "--repeat", "1", "--cols", "48"])
    assert [r["mode"] for r in report["results"]] == ["top-k", "all experts"]
    assert all(r["finite"] and r["seconds"] > 0 and r["tflop"] > 0 for r in report["results"])
    assert report["results"][1]["tflop"] > report["results"][0]["tflop"]
    assert json.loads((tmp_path / "forward_gpu_layer.json").read_text())["cols"] == 48
    assert "all experts" in capsys.readouterr().out


def test_calibrate_layer_bench_projects_every_part_of_a_layer(tmp_path, monkeypatch, capsys):
    """The projection bench/rehearsal.py reads: the collector's pass scaled to 250 rows, the experts' own
    Hessians (timed at two row counts) extrapolated and never below what either count measured, the finish."""
    monkeypatch.setenv("OUT", str(tmp_path))
    with script_module(CALIBRATE_BENCH) as bench:
        report = bench.main(["--tiny", "--rows", "1", "--cols", "32"])
    experts = report["expert_hessians_seconds"]
    assert sorted(experts, key=int) == ["1", "2", "250"]
    assert experts["250"] >= max(experts["1"], experts["2"]) > 0
    collect = report["results"][1]
    assert collect["mode"] == "collect, all experts"
    expected = collect["seconds"] * 250 + experts["250"] + report["finish_seconds"][collect["mode"]]
    assert abs(report["projected_layer_seconds_at_250_rows"] - expected) < 1e-9
    assert json.loads((tmp_path / "calibrate_gpu_layer.json").read_text()) == report
    assert "experts' own Hessians: 1 rows" in capsys.readouterr().out


def test_layer_flops_match_the_active_parameters():
    """About 2 FLOPs per active weight per token (377M active per V4.1-Flash layer), plus attention."""
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    per_token = layer_flops(cfg, 2, 2048) / 2048
    assert 2 * 0.33e9 < per_token < 2 * 0.5e9
    assert layer_flops(cfg, 2, 2048, all_experts=True) > 20 * layer_flops(cfg, 2, 2048)
