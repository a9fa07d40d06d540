"""The allocator at the real V4.1-Flash shape (sparse layout, synthetic calibration summary):
planning for a topology with `quantizer plan --sparks N --context C`, its work, what fits and
what cannot; the extended `quantizer plan` command."""

from __future__ import annotations

import re

import pytest
from test_allocate import with_cold_experts  # tests/ is on sys.path (pytest prepend import mode)

from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXLLAMAV3, VLLM_EXL3, load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import rate_grid
from quantizer.fit.memory import fit
from quantizer.fit.target import largest_fitting_plan
from quantizer.fit.memory import FitTarget
from quantizer.model.targets import targets
from quantizer.plan.allocate import AllocationSettings, allocate
from quantizer.plan.methods import OURS, planner
from quantizer.plan.recipe import plan_from_recipe, read_recipe
from quantizer.plan.sensitivity import sensitivity, synthetic_summary
from quantizer.shipped import model_config_path

MILLION = 1 << 20


@pytest.fixture
def v41(real_v41):  # tests/conftest.py: shared by the session
    return real_v41


@pytest.mark.slow
def test_two_sparks_at_1m_plans_in_few_probes_and_fits(v41, tmp_path, capsys, monkeypatch):
    # counted work, not seconds: one sensitivity, and the search for the most bits that fit plans a
    # handful of budgets (fit/memory.py: the lowest rate, then two to four Newton probes)
    import quantizer.plan.methods as methods
    from quantizer.plan.allocate import Allocator

    calls = {"sensitivity": 0, "plans": []}

    def counted_sensitivity(*args, **kwargs):
        calls["sensitivity"] += 1
        return sensitivity(*args, **kwargs)

    def counted_plan(self, budget, **kwargs):
        calls["plans"].append(kwargs.get("target_bpw"))
        return real_plan(self, budget, **kwargs)

    real_plan = Allocator.plan
    monkeypatch.setattr(methods, "sensitivity", counted_sensitivity)
    monkeypatch.setattr(Allocator, "plan", counted_plan)
    code = main(["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "2", "--context", "1M", "--synthetic",
                 "--loader", "vllm-exl3", "--out", str(tmp_path / "p.json"), "--recipe-out",
                 str(tmp_path / "r.yaml")])
    out = capsys.readouterr().out
    assert code == 0 and "FITS: fits 2 Sparks" in out and "a synthetic calibration" in out
    # one K tuple a layer (the default layout) moves bytes in steps of a layer: a probe or two more than per expert
    assert calls["sensitivity"] == 1 and 2 <= len(calls["plans"]) <= 6, calls
    assert len(set(calls["plans"])) == len(calls["plans"]), calls  # no budget planned twice
    plan = Plan.load(tmp_path / "p.json")
    # the most that fits keeping the 1 GiB margin: a whole 0.01 bpw more would not
    assert 2.5 < plan.achieved_bpw < 3.3
    report = fit(v41, pack_spec(v41, plan).tensors, FitTarget(2, MILLION))
    assert report.fits and 1.0 <= min(r.free_gib for r in report.ranks) < 1.0 + 0.01 * 550e9 / 8 / 2 / (1 << 30)
    header = (tmp_path / "r.yaml").read_text()
    assert "Budget: the most bits that fit 2 Sparks at 1,048,576 tokens" in header
    assert "--sparks 2 --context 1048576 --loader vllm-exl3 --synthetic --seed 0" in header
    assert plan_from_recipe(v41, read_recipe(tmp_path / "r.yaml"), profile=load_profile("vllm-exl3")).k == plan.k
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--plan", str(tmp_path / "p.json"),
                 "--sparks", "2", "--context", "1M"]) == 0  # charged to the engine it was planned for
    capsys.readouterr()


@pytest.mark.parametrize("bpw", [2.5, 2.9, 3.5])
def test_equal_bpw_plans_are_within_one_percent_in_bytes(v41, real_v41_synthetic_sensitivity, real_v41_uniform, bpw):
    def routed_and_budgeted(plan):
        classes = {t.cls for t in targets(v41) if t.budgeted}
        return sum(n for c, n in plan.expected_bytes.items() if c in classes)

    uniform = routed_and_budgeted(real_v41_uniform(bpw))
    ours = allocate(v41, real_v41_synthetic_sensitivity, bpw, AllocationSettings(profile=load_profile(EXLLAMAV3)))
    assert abs(routed_and_budgeted(ours) / uniform - 1) < 0.01


def most_that_fits(cfg, target, settings=AllocationSettings()):
    # as `plan --sparks` and `build --sparks` ask fit: our allocator on a synthetic summary
    plan_at, lowest = planner(cfg, OURS, settings, synthetic_summary(cfg))
    return largest_fitting_plan(cfg, plan_at, lowest, rate_grid(settings.codebook)[-1], target)


@pytest.mark.slow
def test_vllm_exl3_mixes_routed_k_per_expert_and_keeps_the_rest_in_source_form(v41):
    """The seed's vLLM shape with --expert-layout per-expert: routed experts EXL3 with K per expert (K2..K8, what
    the plugin's tensor-mixed store loads), everything else FP8 source form as a fixed cost, every expert stored. On
    one Spark it cannot fit (every routed expert at K2 is already 127 GiB), and the refusal says by how much."""
    with pytest.raises(UserError, match=r"does not fit 1 Spark at 524,288 tokens .* short by [\d.]+ GiB"):
        most_that_fits(v41, FitTarget(1, 512 * 1024), AllocationSettings(profile=load_profile(VLLM_EXL3)))
    fitted = most_that_fits(v41, FitTarget(2, MILLION), AllocationSettings(profile=load_profile(VLLM_EXL3),
                                                                             expert_layout="per-expert"))
    plan, report = fitted.plan, fitted.report
    assert report.fits and report.sparks == 2 and plan.profile.name == VLLM_EXL3 and not plan.aliases
    assert all(plan.k[t.key] is None for t in targets(v41) if t.group != "routed")
    by_layer = {}
    for t in targets(v41):
        if t.group == "routed":
            by_layer.setdefault(t.layer, set()).add(plan.k[t.key])
    assert any(len(ks) > 1 for ks in by_layer.values())  # K mixed per expert inside a layer
    assert min(min(ks) for ks in by_layer.values()) >= 2
    assert 2.0 < plan.achieved_bpw < 3.5  # over the routed experts, the only budgeted tensors


def test_a_target_that_cannot_fit_says_by_how_much(capsys):
    # one search, through the command (the in-process call made the same search; its message is the test)
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "1", "--context", "1M",
                 "--streams", "16", "--synthetic"]) == 2
    # the V4.1 default profile for one Spark, exllamav3-v41, loads routed K 1 at the lowest
    assert re.search(r"does not fit 1 Spark at 1,048,576 tokens x 16 streams \(exllamav3-v41\) even at the "
                     r"lowest rates \(1\.000 bpw\): the worst rank is short by [\d.]+ GiB", capsys.readouterr().err)


def test_plan_cli_methods_on_a_small_model(tmp_path, capsys):
    small = str(model_config_path("small-v41.json"))
    summary = with_cold_experts(synthetic_summary(ModelConfig.from_file(small))).save(tmp_path / "cold.json")
    for loader in ("vllm-exl3", "tensorfold"):
        assert main(["plan", "--model-config", small, "--bpw", "2.9", "--calibration", str(summary),
                     "--loader", loader, "--out", str(tmp_path / "p.json"), "--recipe-out", str(tmp_path / "r.yaml")]) == 0
        out = capsys.readouterr().out
        plan = Plan.load(tmp_path / "p.json")
        assert plan.profile.name == loader and not plan.aliases and "routed experts by layer (mean K): L0 " in out
    # uniform stays the default without calibration; ours needs a summary
    assert main(["plan", "--model-config", small, "--bpw", "2.9"]) == 0
    assert capsys.readouterr().out.startswith("a uniform 2.9 bpw plan (mul1 codebook, routed experts at ")
    assert main(["plan", "--model-config", small, "--bpw", "2.9", "--method", "ours"]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main(["plan", "--model-config", small, "--synthetic"]) == 2
    assert "--bpw B, or --sparks N" in capsys.readouterr().err
    assert main(["plan", "--model-config", small, "--bpw", "2.9", "--method", "exl3"]) == 2
    assert "--method exl3 plans exllamav3's own layout" in capsys.readouterr().err  # V4.1: vllm-exl3 by default
    assert main(["plan", "--model-config", small, "--bpw", "2.9", "--calibration", str(summary), "--alias"]) == 2
    assert "--alias: the vllm-exl3 engine reads every expert's own tensors" in capsys.readouterr().err
    # a --bpw plan checked against a topology: exit 1 when it does not fit
    assert main(["plan", "--model-config", small, "--bpw", "2.9", "--synthetic", "--sparks", "1",
                 "--context", "1M", "--streams", "16"]) == 0
    assert "FITS: fits 1 Spark" in capsys.readouterr().out
    assert main(["plan", "--model-config", small, "--bpw", "2.9", "--synthetic", "--sparks", "1",
                 "--context", "1M", "--streams", "160"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    # a calibrate work directory is read through its summary.json
    work = tmp_path / "calibration"
    work.mkdir()
    synthetic_summary(ModelConfig.from_file(small), seed=2).save(work / "summary.json")
    assert main(["plan", "--model-config", small, "--bpw", "3.5", "--calibration", str(work)]) == 0
    assert "a synthetic calibration" in capsys.readouterr().out
    assert main(["plan", "--model-config", small, "--bpw", "3.5", "--calibration", str(tmp_path / "none")]) == 2
    assert "not found" in capsys.readouterr().err
    assert CalibrationSummary.load(work / "summary.json").synthetic
