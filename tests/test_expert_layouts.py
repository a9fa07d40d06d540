"""Expert layouts the allocator can be held to (issue 58): per-expert K, a few groups of experts per layer with one
K for gate, up and down, or one K tuple per layer (what the engines' fused MoE kernels take), with or without half
rates; every layout on every profile, and the refusals."""

from __future__ import annotations

from collections import defaultdict

import pytest
from one_line import one_line

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXPERT_LAYOUTS, loader_names, load_profile
from quantizer.contract.plan import Plan
from quantizer.model.targets import ROUTED, targets
from quantizer.plan.allocate import AllocationSettings, allocate
from quantizer.plan.sensitivity import synthetic_summary, sensitivity
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path

PAIRS = [(name, layout) for name in loader_names() for layout in load_profile(name).layouts.allowed]  # what each engine loads


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_file(model_config_path(name))


def tuples_by_layer(cfg: ModelConfig, plan: Plan) -> dict[int, dict[tuple, list[int]]]:
    """Layer -> (K of gate, up, down) -> the experts that hold it."""
    per_expert: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for t in targets(cfg):
        if t.group == ROUTED:
            per_expert[t.layer, t.expert][t.proj] = plan.k[t.key]
    out: dict[int, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))
    for (layer, expert), k in per_expert.items():
        out[layer][(k["w1"], k["w3"], k["w2"])].append(expert)
    return out


def assert_layout(cfg: ModelConfig, plan: Plan, layout: str, tie: str, groups: int, min_group: int) -> None:
    for layer, tuples in tuples_by_layer(cfg, plan).items():
        if layout == "per-layer":
            assert len(tuples) == 1, (layer, tuples)
        if layout == "grouped":
            assert len(tuples) <= groups and all(len(es) >= min_group for es in tuples.values()), (layer, tuples)
        for gate, up, down in tuples:
            if layout == "grouped" or (layout == "per-layer" and tie == "all"):
                assert gate == up == down, (layer, tuples)
            elif layout == "per-layer":
                assert gate == up, (layer, tuples)


@pytest.mark.parametrize("loader, layout", PAIRS)
def test_every_layout_on_every_profile_meets_its_rule_at_its_budget(loader, layout):
    cfg = _model("small-v41.json")
    sens = sensitivity(cfg, synthetic_summary(cfg), "mul1")
    settings = AllocationSettings(profile=load_profile(loader), expert_layout=layout)
    profile = load_profile(loader)
    budgeted_routed_only = loader in ("vllm-exl3", "exllamav3-v41")  # everything else in source form: no floor
    for bpw in (1.6 if budgeted_routed_only and profile.k_min < 2 else 2.2 if budgeted_routed_only else 3.5, 2.9 + 1.5
                * (not budgeted_routed_only)):
        plan = allocate(cfg, sens, bpw, settings)
        assert plan.achieved_bpw <= bpw + 1e-9 and plan.profile.name == loader
        assert_layout(cfg, plan, layout, profile.layouts.fused_tie, profile.layouts.groups, profile.layouts.min_group)
        routed = {plan.k[t.key] for t in targets(cfg) if t.group == ROUTED}
        assert profile.layouts.half_rates or all(k == int(k) for k in routed), routed
        uniform = uniform_plan(cfg, bpw, profile=load_profile(loader), expert_layout=layout,
                               head_bits=None if budgeted_routed_only else 6)
        assert_layout(cfg, uniform, layout, profile.layouts.fused_tie, profile.layouts.groups, profile.layouts.min_group)


def _cost(cfg, sens, bpw: float, **settings) -> float:
    plan = allocate(cfg, sens, bpw, AllocationSettings(**settings))
    rows, rates = {key: i for i, key in enumerate(sens.keys)}, list(sens.rates)
    return sum(float(sens.cost[rows[k], rates.index(v)]) for k, v in plan.k.items() if k in rows and v is not None)


def test_a_tighter_layout_costs_more_at_equal_bits_and_half_rates_lower_the_cost():
    """At one budget the allocator's estimated cost grows as the layout ties more experts together: per-layer with
    gate = up = down is a special case of grouped, which is one of per-expert; half rates can only help."""
    cfg = _model("small-v41.json")
    sens = sensitivity(cfg, synthetic_summary(cfg), "mul1")
    tied = [_cost(cfg, sens, 3.0, profile=load_profile("tensorfold"), expert_layout=layout) for layout in EXPERT_LAYOUTS]
    assert tied[0] <= tied[1] <= tied[2] and tied[0] < tied[2]
    one_spark = {(layout, halves): _cost(cfg, sens, 1.8, profile=load_profile("exllamav3-v41"), expert_layout=layout,
                                         half_rates=halves, head_bits=None)
                 for layout in EXPERT_LAYOUTS for halves in (False, True)}
    for halves in (False, True):
        assert one_spark["per-expert", halves] <= min(one_spark["grouped", halves], one_spark["per-layer", halves])
    assert all(one_spark[layout, True] <= one_spark[layout, False] for layout in EXPERT_LAYOUTS)


def test_stock_exllamav3_loads_one_k_per_projection_per_layer_only(capsys):
    v4 = _model("small-v4.json")
    plan = allocate(v4, sensitivity(v4, synthetic_summary(v4), "mul1"), 2.9, AllocationSettings())
    assert_layout(v4, plan, "per-layer", "gate+up", 4, 4)
    for layout in ("per-expert", "grouped"):
        assert main(["plan", "--model-config", "small-v4", "--synthetic", "--bpw", "2.9", "--expert-layout",
                     layout]) == 2
        one_line(capsys.readouterr().err, f"--expert-layout {layout}: the exllamav3 engine loads per-layer only")


@pytest.mark.parametrize("flags, message", [
    (["--expert-layout", "diagonal"], "argument --expert-layout: invalid choice: 'diagonal'"),
    (["--loader", "vllm-exl3", "--half-rates"], "--half-rates: the vllm-exl3 engine reads integer K only"),
    (["--loader", "exllamav3-v41", "--half-rates", "--codebook", "mcg"],
     "--half-rates: the exllamav3-v41 engine reads half rates with mul1"),
])
def test_bad_layout_flags_get_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) if "diagonal" in flags else _no_raise():
        code = main(["plan", "--model-config", "small-v41", "--synthetic", "--bpw", "2.4", *flags])
        assert code == 2
    one_line(capsys.readouterr().err, message)


def test_build_refuses_layout_flags_with_a_plan(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["plan", "--model-config", "small-v41", "--synthetic", "--bpw", "2.4", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["build", "SRC", "--plan", str(plan), "--expert-layout", "per-layer", "--out", str(tmp_path / "x")]) == 2
    one_line(capsys.readouterr().err, "--expert-layout and --half-rates make a plan")


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
