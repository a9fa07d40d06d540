"""The GPU layer benchmark's logic at tiny shapes (it must not first break on the GPU machine),
and the FLOP count it reports."""

from __future__ import annotations

import json
from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.flops import layer_flops
from quantizer.shipped import model_config_path
from script_module import script_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "forward_gpu_layer.py"


def test_gpu_layer_bench_runs_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    with script_module(BENCH) as bench:
        report = bench.main(["--tiny", "--repeat", "1", "--cols", "48"])
    assert [r["mode"] for r in report["results"]] == ["top-k", "all experts"]
    assert all(r["finite"] and r["seconds"] > 0 and r["tflop"] > 0 for r in report["results"])
    assert report["results"][1]["tflop"] > report["results"][0]["tflop"]
    assert json.loads((tmp_path / "forward_gpu_layer.json").read_text())["cols"] == 48
    assert "all experts" in capsys.readouterr().out


def test_layer_flops_match_the_active_parameters():
    """About 2 FLOPs per active weight per token (377M active per V4.1-Flash layer), plus attention."""
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    per_token = layer_flops(cfg, 2, 2048) / 2048
    assert 2 * 0.33e9 < per_token < 2 * 0.5e9
    assert layer_flops(cfg, 2, 2048, all_experts=True) > 20 * layer_flops(cfg, 2, 2048)
