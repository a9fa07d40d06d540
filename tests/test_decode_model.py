"""What a decode token costs in its engine (issue 58; quantizer/fit/decode.py, docs/decode-speed.md): the constants
are the fit of published rates and predict the ones held out; the dispatch path each layout reaches in each engine;
and plan, fit and the pack's card carry the rate, the bytes and the launches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import script_module

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.fit.decode import FUSED, MIXED, decode_cost, layer_paths
from quantizer.fit.hardware import load_hardware
from quantizer.plan.allocate import AllocationSettings, allocate
from quantizer.plan.sensitivity import sensitivity, synthetic_summary
from quantizer.shipped import model_config_path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode_model.py"


@pytest.mark.slow
def test_the_shipped_constants_are_the_fit_of_published_rates_and_predict_the_held_out_ones():
    with script_module(BENCH) as bench:
        hw = load_hardware()
        measured = bench.measure(hw=hw)
        fitted = bench.fit_constants(measured, hw)
        rows = bench.report(measured, hw.decode)
    for name in bench.FITTED:
        assert getattr(fitted, name) == pytest.approx(getattr(hw.decode, name), rel=0.01), name
    held_out = [r for r in rows if r["role"] == "held out"]
    assert len(held_out) == 3 and all(0.9 <= r["ratio"] <= 1.1 for r in held_out), held_out
    assert all(0.85 <= r["ratio"] <= 1.15 for r in rows), rows  # every point within 15%, held out or not
    one_spark = next(r for r in rows if r["point"] == "one Spark, 1.59 bpw, no drafter")
    assert 7.0 < one_spark["gib"] < 7.4  # the recipe counts about 7.2 GiB read a token (docs/decode-speed.md)


def _plan(layout: str, loader: str, bpw: float = 2.4):
    cfg = ModelConfig.from_file(model_config_path("small-v41.json"))
    plan = allocate(cfg, sensitivity(cfg, synthetic_summary(cfg), "mul1"), bpw,
                    AllocationSettings(profile=load_profile(loader), expert_layout=layout,
                                       head_bits=None if loader != "tensorfold" else 6.0))
    return cfg, plan


@pytest.mark.parametrize("loader, layout, path, graphed, drafts", [
    ("vllm-exl3", "per-layer", FUSED, True, True),  # exl3_moe in vLLM's CUDA graphs
    ("vllm-exl3", "per-expert", MIXED, False, False),  # the tensor-mixed store: eager, no speculation
    ("exllamav3-v41", "per-layer", FUSED, False, True),
    ("exllamav3-v41", "per-expert", MIXED, False, True),  # the dense per-expert loop
    ("tensorfold", "per-expert", FUSED, True, True),  # three launches a layer for any mix of K
])
def test_each_layout_reaches_its_engines_dispatch_path(loader, layout, path, graphed, drafts):
    cfg, plan = _plan(layout, loader, 2.4 if loader != "exllamav3-v41" else 1.8)
    profile = load_profile(loader)
    paths = layer_paths(cfg, plan, profile)
    assert path in paths.values() and (path == MIXED or set(paths.values()) == {FUSED})
    cost = decode_cost(cfg, plan, list(pack_spec(cfg, plan).tensors), profile, 1 if loader == "exllamav3-v41" else 2,
                       load_hardware(), 4096, drafter=True)
    assert cost.graphed == graphed and (cost.with_drafter is not None) == drafts
    assert cost.tokens_per_second > 0 and cost.gib_per_token > 0 and cost.launches_per_token > cfg.num_layers


def test_a_mixed_layer_costs_launches_and_a_longer_context_costs_bytes():
    cfg, mixed = _plan("per-expert", "exllamav3-v41", 1.8)
    _, uniform = _plan("per-layer", "exllamav3-v41", 1.8)
    profile, hw = load_profile("exllamav3-v41"), load_hardware()

    def cost(plan, context):
        return decode_cost(cfg, plan, list(pack_spec(cfg, plan).tensors), profile, 1, hw, context, drafter=False)

    assert cost(mixed, 4096).launches_per_token > cost(uniform, 4096).launches_per_token
    short, long = cost(uniform, 4096), cost(uniform, 1 << 20)
    assert long.gib_by_part["kv"] > short.gib_by_part["kv"] and long.tokens_per_second < short.tokens_per_second


def test_plan_fit_and_the_card_carry_the_rate_bytes_and_launches(capsys):
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "1", "--context", "512K", "--bpw", "1.5",
                 "--overlay", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    decode = data["fit"]["decode"]
    assert decode["engine"] == "exllamav3-v41" and decode["context"] == 524_288
    assert 10 < decode["tokens_per_second"] < 25 and decode["with_drafter"] > decode["tokens_per_second"]
    assert 6 < decode["gib_per_token"] < 10 and decode["launches_per_token"] > 1000
    assert "a model" in decode["model"] and data["gpu_hours"]["ours"] > 1
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", "mia-2.9", "--sparks", "2"]) == 0
    out = capsys.readouterr().out
    assert "decode (a model, docs/decode-speed.md): ~" in out and "kernel launches a token (in CUDA graphs" in out
