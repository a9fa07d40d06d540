"""Cold-expert aliases are refused with one line: no engine profile reads an alias map
(docs/loader-profiles.md), so a pack must never leave an expert out."""

from __future__ import annotations

from quantizer.contract.loader_profiles import load_profile
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.plan.uniform import uniform_plan

COLD, WARM = "layers.0.ffn.experts.7", "layers.0.ffn.experts.2"


def test_a_plan_with_aliased_experts_is_refused_before_any_stage(tiny_v41, tmp_path, capsys):
    cfg = Checkpoint.open(tiny_v41).config
    plan = uniform_plan(cfg, 2.5, profile=load_profile("vllm-exl3"))
    Plan(plan.arch, plan.codebook, plan.profile, plan.k, plan.target_bpw, {COLD: WARM}).save(tmp_path / "plan.json")
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--plan", str(tmp_path / "plan.json"), "--out", str(pack),
                 "--no-calibrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{COLD}: aliased to {WARM}" in err[0] and "rule aliases: vcruz305/vllm-exl3" in err[0]
    assert not pack.exists() and not (tmp_path / "pack.work").exists()


def test_the_alias_flag_is_refused_for_every_engine(tiny_v41, capsys):
    for loader in ("vllm-exl3", "tensorfold"):
        assert main(["plan", str(tiny_v41), "--bpw", "2.5", "--synthetic", "--alias", "--loader", loader]) == 2
        err = capsys.readouterr().err
        assert f"--alias: the {loader} engine reads every expert's own tensors and no engine profile reads an " \
               "alias map" in err
