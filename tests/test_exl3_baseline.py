"""plan/exl3_baseline.py: exllamav3 1.6.5's create_q_strategy run on the CPU (extension stubbed) for
a V4 twin of our shapes, mapped back to a Plan at equal bytes; and how ours compares under the
cost model. Skipped only when exllamav3 is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_allocate import budget_bytes  # tests/ is on sys.path (pytest prepend import mode)

from quantizer import caches
from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile
from quantizer.contract.pack_spec import aliased_keys
from quantizer.contract.plan import Plan
from quantizer.contract.rules import achieved_bpw, check_plan
from quantizer.errors import UserError
from quantizer.model.targets import ATTN, ENGRAM, INDEX, ROUTED, targets
from quantizer.plan import exl3_baseline
from quantizer.plan.allocate import AllocationSettings, allocate
from quantizer.plan.exl3_baseline import exl3_plan, exl3_strategy, v4_twin_config
from quantizer.plan.sensitivity import sensitivity, synthetic_summary
from quantizer.shipped import model_config_path

MISSING = exl3_baseline.missing_for_baseline()
needs_exllamav3 = pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not installed "
                                                           "(pip install 'quantizer[demo]')")


def config(name: str) -> ModelConfig:
    return ModelConfig.from_file(model_config_path(name))


def test_v4_twin_of_v41_maps_compressed_layers_by_indexer():
    cfg = config("deepseek-v4.1-flash.json")
    twin = v4_twin_config(cfg)
    ratios = twin["compress_ratios"]
    assert len(ratios) == 40 and twin["num_hash_layers"] == 0 and twin["architectures"] == ["DeepseekV4ForCausalLM"]
    assert [L for L, r in enumerate(ratios) if r == 4] == [2, 8, 14, 20, 24, 28, 32, 36]  # our index sources
    assert ratios[:2] == [0, 0] and ratios[3] == 128 and ratios[39] == 128
    assert (twin["hidden_size"], twin["n_routed_experts"], twin["q_lora_rank"]) == (5120, 384, 1280)
    assert v4_twin_config(config("tiny-v4.json"))["compress_ratios"] == [0, 0, 4, 128, 4, 0]


@needs_exllamav3
def test_create_q_strategy_as_documented():
    """docs/exl3-format.md, allocator: -b 2.5 -hq 1 gives experts 2.5, attention and shared experts 4;
    all experts of a layer share one K; DSV4 attention takes integer K only."""
    cfg = config("tiny-v4.json")
    strategy, final = exl3_strategy(cfg, 2.5, hq=1)
    experts = {k: v for k, v in strategy.items() if ".ffn.experts." in k}
    assert set(experts.values()) == {2.5} and len(experts) == 6 * 8 * 3
    assert {v for k, v in strategy.items() if ".attn." in k} == {4}
    assert {v for k, v in strategy.items() if ".shared_experts." in k} == {4} and strategy["head"] == 6
    assert final > 2.5  # -hq lifts the floors above the budget
    # a real-size shape: expert K varies between layers, never within one; the ends of the stack first
    v41 = config("deepseek-v4.1-flash.json")
    strategy, _ = exl3_strategy(v41, 2.3, hq=1)
    per_layer = {}
    for key, rate in strategy.items():
        if ".ffn.experts." in key:
            per_layer.setdefault(int(key.split(".")[1]), set()).add(rate)
    assert all(len(r) == 1 for r in per_layer.values())
    k = [next(iter(per_layer[L])) for L in range(40)]
    assert k[0] == k[39] == max(k) and k[20] == min(k) < max(k)
    assert all(float(v).is_integer() for key, v in strategy.items() if ".attn." in key)


@needs_exllamav3
@pytest.mark.parametrize("name", ["tiny-v41.json", "small-v41.json"])
def test_exl3_plan_maps_back_at_equal_bytes(name):
    cfg = config(name)
    plan = exl3_plan(cfg, 2.9)
    check_plan(cfg, plan)
    assert plan.made_by.startswith("exllamav3.create_q_strategy(") and plan.profile.name == EXLLAMAV3
    assert plan.achieved_bpw <= 2.9 + 1e-9 and plan.target_bpw == 2.9
    rates = {}
    for t in targets(cfg):
        k = plan.k[t.key]
        if t.group == ROUTED:
            rates.setdefault((t.layer, t.proj), set()).add(k)
        elif t.group in (ATTN, INDEX):
            assert k == int(k)
        if t.group == ENGRAM:
            assert k == plan.k[f"layers.{t.layer}.attn.wkv"]
    assert all(len(r) == 1 for r in rates.values())
    assert plan.k["head"] == 6.0 and plan.k["mtp.0.ffn.experts.0.w1"] is None
    # the largest exllamav3 input whose plan stays in budget: a little more would exceed it
    bits = float(plan.made_by.split("bits=")[1].split(",")[0])
    strategy, _ = exl3_strategy(cfg, bits + 2 * exl3_baseline.MATCH_TOLERANCE)
    more = Plan(cfg.arch, "mul1", load_profile(EXLLAMAV3), exl3_baseline.our_rates(cfg, strategy, 6.0, None))
    assert achieved_bpw(cfg, more) > 2.9


@needs_exllamav3
@pytest.mark.parametrize("bpw", [2.5, 2.9, 3.5])
def test_ours_costs_less_than_exl3_at_its_bytes(bpw):
    cfg = config("small-v41.json")
    sens = sensitivity(cfg, synthetic_summary(cfg))
    base = exl3_plan(cfg, bpw)
    col = {r: i for i, r in enumerate(sens.rates)}

    def cost(plan):
        cold = aliased_keys(plan)
        rows = [i for i, k in enumerate(sens.keys) if k not in cold]
        return float(sens.cost[rows, [col[plan.k[sens.keys[i]]] for i in rows]].sum()) + \
            sum(a.cost for a in sens.aliases if a.expert in plan.aliases)

    for mode in (EXLLAMAV3,):
        ours = allocate(cfg, sens, base.achieved_bpw, AllocationSettings(profile=load_profile(mode)))
        assert ours.achieved_bpw <= base.achieved_bpw + 1e-9
        assert abs(budget_bytes(cfg, ours) / budget_bytes(cfg, base) - 1) < 0.002
        assert cost(ours) < cost(base)
    assert np.isfinite(cost(base))


@needs_exllamav3
def test_wo_a_slices_and_compressors_map_to_our_targets():
    cfg = config("tiny-v41.json")
    strategy, _ = exl3_strategy(cfg, 2.9)
    assert any(".wo_a.slice." in k for k in strategy) and any(".compressor." in k for k in strategy)
    strategy = dict(strategy)
    strategy["layers.0.attn.wo_a.slice.0"], strategy["layers.0.attn.wo_a.slice.1"] = 5, 4
    k = exl3_baseline.our_rates(cfg, strategy, 6.0, None)
    assert k["layers.0.attn.wo_a"] == 4.0  # mean 4.5 rounded down to an integer rate
    with pytest.raises(ValueError, match="no target"):
        exl3_baseline.our_rates(cfg, {**strategy, "layers.0.attn.nonsense": 4}, 6.0, None)


def test_missing_exllamav3_is_a_user_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "exllamav3" else real(name, *a))
    caches.reset()  # no twin model kept from an earlier test
    with pytest.raises(UserError, match=r"needs exllamav3: pip install exllamav3==1\.6\.5$"):
        exl3_plan(config("tiny-v41.json"), 2.9)


# Run in a fresh interpreter where triton cannot be found, as in a venv of the demo extra alone.
_WITHOUT_TRITON = """
import importlib.abc, importlib.util, json, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "triton" else real(name, *a)
from quantizer.checkpoint.config import ModelConfig
from quantizer.plan.exl3_baseline import exl3_plan
from quantizer.shipped import model_config_path
plan = exl3_plan(ModelConfig.from_file(model_config_path("small-v41.json")), 2.9)
print(json.dumps({"k": plan.k, "triton": sorted(n for n in sys.modules if n.split(".")[0] == "triton")}))
"""


@needs_exllamav3
def test_without_triton_the_baseline_plans_alike_and_leaves_no_triton_behind():
    """The demo extra has no triton: exllamav3's kernel modules import it, the allocator never runs
    them, so a stand-in serves the import and the plan is the one real triton gives."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["triton"] == []  # the stand-in is gone once exllamav3 is imported
    assert out["k"] == exl3_plan(config("small-v41.json"), 2.9).k
