"""One flag for the engine, one answer per question (issue 41): `--loader` names the engine on fit, plan
and build; `--engine` is a hidden, deprecated alias; fit charges the profile `plan` would use (a plan's,
a recipe's, or the one whose rules the layout meets on the Spark count) and so gives plan's verdict and free
memory; --loader sizes any layout in another engine's memory model."""

from __future__ import annotations

import json

import pytest
from one_line import one_line

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import build_parser, main
from quantizer.contract.loader_profiles import loader_names
from quantizer.contract.plan import Plan
from quantizer.pack.manifest import Manifest
from quantizer.plan.recipe import read_recipe, write_recipe
from quantizer.shipped import model_config_path, shipped

TINY = str(model_config_path("tiny-v41.json"))
V41 = ["--model-config", "deepseek-v4.1-flash"]


def _answer(out: str) -> tuple[str, list[str]]:
    """FITS or DOES NOT FIT, and the per-rank rows of the fit table (weights, KV, ..., free, max context)."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    verdict = next(line for line in lines if line.startswith(("FITS:", "DOES NOT FIT:")))
    return verdict.split(":")[0], lines[top: lines.index("", top)]


def _run(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("loader, fits", [
    ("tensorfold", [["--loader", "tensorfold"]]),
    # the question: without a flag fit charges what plan chooses for 2 Sparks (vllm-exl3), and so does
    # the shipped recipe, which names that profile
    ("vllm-exl3", [["--loader", "vllm-exl3"], [], ["--recipe", str(shipped("configs", "recipes", "2.9.yaml"))]]),
])
def test_fit_gives_plans_verdict_and_free_memory_on_the_real_v41(capsys, loader, fits):
    code, planned = _run(capsys, ["plan", *V41, "--bpw", "2.9", "--sparks", "2", "--loader", loader])
    want = _answer(planned)
    assert f"engine {loader}," in planned
    for extra in fits:
        rate = [] if "--recipe" in extra else ["--bpw", "2.9"]
        got_code, out = _run(capsys, ["fit", *V41, *rate, "--sparks", "2", *extra])
        assert (got_code, _answer(out)) == (code, want), extra


def test_fit_sizes_a_recipe_in_any_profile_and_names_what_it_breaks(tmp_path, capsys):
    """Fit is a memory model first (issue 57): --loader picks the engine whose memory is counted; a recipe that
    breaks that profile is sized all the same, with one finding line and the memory verdict's exit code."""
    recipe = tmp_path / "r.yaml"
    assert main(["plan", "--model-config", TINY, "--bpw", "3", "--loader", "tensorfold", "--recipe-out", str(recipe)]) == 0
    capsys.readouterr()
    assert read_recipe(recipe).profile.name == "tensorfold" and "\nloader: tensorfold\n" in recipe.read_text()
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe), "--sparks", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["engine"], data["loader"], data["findings"]) == ("tensorfold", "tensorfold", None)
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe), "--loader", "vllm-exl3"]) == 0
    out = capsys.readouterr().out
    findings = [line for line in out.splitlines() if line.startswith("finding:")]
    assert len(findings) == 1 and "engine vllm-exl3," in out and "FITS:" in out
    assert "rule(s) of the vllm-exl3 loader profile (layout " in findings[0] and "`plan` and `build` refuse it" in findings[0]
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe), "--loader", "vllm-exl3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"]["profile"] == "vllm-exl3" and data["findings"]["count"] == sum(data["findings"]["by_rule"].values())
    # a recipe without a profile: the one whose rules it meets on the Spark count, named in the output
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("loader:")))
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe), "--sparks", "4"]) == 0
    out = capsys.readouterr().out
    assert "r.yaml (names no loader profile: read for tensorfold, whose rules it meets)" in out and "finding:" not in out
    assert main(["plan", "--model-config", TINY, "--bpw", "3", "--recipe-out", str(recipe)]) == 0
    recipe.write_text("\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("loader:")))
    capsys.readouterr()
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe), "--sparks", "4"]) == 0
    assert "r.yaml (names no loader profile: read for vllm-exl3, the default for v41 on 4 Sparks)" in \
        capsys.readouterr().out
    recipe.write_text("loader: vllm\n" + recipe.read_text())
    assert main(["fit", "--model-config", TINY, "--recipe", str(recipe)]) == 2
    one_line(capsys.readouterr().err, "loader 'vllm'; choose one of exllamav3, vllm-exl3, tensorfold, exllamav3-v41")


@pytest.mark.parametrize("command", [["fit", "--model-config", TINY, "--bpw", "3"],
                                     ["plan", "--model-config", TINY, "--bpw", "3"],
                                     ["build", "SRC", "--bpw", "3", "--out", "PACK"]])
def test_engine_is_a_hidden_alias_and_the_design_floor_is_refused(command, capsys):
    assert "--engine" not in build_parser().parse_args(command).parser.format_help()
    text = "".join(build_parser().parse_args(command).parser.format_help().split())  # argparse wraps at hyphens
    assert "--loaderPROFILE" in text and all(f"{name}:" in text for name in loader_names())  # each with its line
    assert main(command + ["--engine", "native"]) == 2
    one_line(capsys.readouterr().err, "--engine native: not an engine a pack runs in",
             "use --loader exllamav3|vllm-exl3|tensorfold|exllamav3-v41")
    assert main(command + ["--engine", "bogus"]) == 2
    err = one_line(capsys.readouterr().err, "--engine bogus: no such engine", "use --loader exllamav3|vllm-exl3")
    assert "native" not in err  # not the design floor's text (issue 60)


def test_old_engine_names_still_work_with_a_note(capsys):
    args = ["fit", "--model-config", TINY, "--bpw", "3", "--sparks", "2", "--json"]
    assert main(args + ["--loader", "vllm-exl3"]) == 0
    want = capsys.readouterr().out
    assert main(args + ["--engine", "vllm"]) == 0
    captured = capsys.readouterr()
    assert captured.out == want and json.loads(want)["engine"] == "vllm-exl3"
    assert captured.err == "note: --engine is deprecated; --engine vllm is --loader vllm-exl3\n"


def test_an_argument_fit_does_not_take_is_named_with_fits_usage(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--loader", "tensorfold", "--model-config", TINY, "--sparks", "2", "--synthetic"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("usage: quantizer fit ") and "--loader" in err
    assert err.rstrip().endswith("quantizer fit: error: unrecognized arguments: --synthetic")


def test_build_takes_a_recipe_and_its_profile_decides(tiny_v41, fp16_plan, tmp_path, capsys):
    plan = Plan.load(fp16_plan)
    recipe = write_recipe(Checkpoint.open(tiny_v41).config, plan, tmp_path / "r.yaml")
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--recipe", str(recipe), "--loader", "tensorfold", "--out", str(pack),
                 "--no-calibrate"]) == 2
    one_line(capsys.readouterr().err, f"--loader tensorfold conflicts with {recipe}, which is made for the "
                                      f"{plan.profile.name} loader profile")
    assert main(["build", str(tiny_v41), "--recipe", str(recipe), "--out", str(pack), "--no-calibrate"]) == 0
    capsys.readouterr()
    built = Manifest.load(pack).plan
    assert (built["hash"], built["loader"]) == (plan.content_hash(), plan.profile.name)  # the plan `plan` wrote
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build", "SRC", "--recipe", str(recipe), "--bpw", "3", "--out", "PACK"])
    assert "not allowed with argument" in capsys.readouterr().err
