"""`quantizer build` end to end with our allocator: the bundled model calibrated on the shipped set,
allocated for vllm-exl3 (routed experts, K per expert), quantized with its Hessians, packed, verified; the plan kept as JSON and
as an exllamav3 recipe; inputs that cannot make a plan are refused before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantizer.orchestrate.stages import plan_files
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.pack.manifest import MANIFEST_NAME
from quantizer.shipped import shipped

SMALL = str(shipped("small_model"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ours")
    args = ["build", SMALL, "--bpw", "2.9", "--loader", "vllm-exl3", "--calib-rows", "4", "--calib-cols", "256",
            "--out", str(root / "pack")]
    assert main(args) == 0
    return root


def test_the_pack_is_calibrated_allocated_and_verified(built, capsys):
    manifest = json.loads((built / "pack" / MANIFEST_NAME).read_text())
    assert manifest["settings"]["calibration"]["rows"] == 4
    plan = Plan.load(plan_files(built / "pack.work", built / "pack")[0])
    assert plan.profile.name == "vllm-exl3" and plan.made_by.startswith("our allocator's 2.9 bpw plan (")
    assert "a measured calibration with measured-kl site gains" in plan.made_by
    # vllm-exl3's default layout is one K per layer: the budget is reached within one of the 6 layers' steps
    assert 2.9 - 1 / 6 < plan.achieved_bpw <= 2.9
    assert manifest["aliases"] == plan.aliases
    assert plan_files(built / "pack.work", built / "pack")[1].read_text().count("\n") > 10
    assert main(["verify", str(built / "pack"), "--full"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("clean")


def test_a_rerun_resumes_without_encoding_again(built, capsys):
    (built / "again").mkdir()
    args = ["build", SMALL, "--bpw", "2.9", "--loader", "vllm-exl3", "--calib-rows", "4", "--calib-cols", "256",
            "--out", str(built / "again" / "pack"), "--work", str(built / "pack.work")]
    assert main(args) == 0
    assert "(0 of " in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--bpw", "2.5", "--no-calibrate"], "--method ours allocates from a calibration"),
    (["--bpw", "2.5", "--context", "64K"], "add --sparks"),
    (["--bpw", "2.5", "--method", "uniform", "--loader", "tensorfold", "--codebook", "mcg"],
     "layers.0.attn.wq_a: codebook mcg; this loader takes mul1"),
    (["--bpw", "2.5", "--tokens", "ids.txt"], "--tokens takes a .npy or .safetensors file"),
    (["--bpw", "0.5"], "--bpw 0.5 is too low"),  # refused before calibration, not after
])
def test_inputs_that_cannot_make_a_plan_exit_2(tmp_path, capsys, extra, message):
    assert main(["build", SMALL, "--out", str(tmp_path / "pack"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "pack").exists() and not (tmp_path / "pack.work" / "calibration").exists()


@pytest.mark.slow  # a whole build (the tests of `built` are slow through tests/conftest.py)
def test_sparks_builds_the_most_bits_that_fit(tmp_path, capsys):
    args = ["build", SMALL, "--sparks", "1", "--context", "64K", "--method", "uniform", "--no-calibrate",
            "--out", str(tmp_path / "pack")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FITS: fits 1 Spark" in out and "65,536 tokens" in out
    plan = Plan.load(plan_files(tmp_path / "pack.work", tmp_path / "pack")[0])
    assert plan.achieved_bpw == pytest.approx(8.0)  # a 6.5M-parameter model fits at the highest rate


@pytest.mark.slow  # allocates at the real V4.1-Flash shape (18 s on 2 busy cores)
def test_a_target_nothing_fits_is_refused_before_calibration(full_v41, tmp_path, capsys):
    out, ids = tmp_path / "pack", tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, 1000, size=(2, 64)))
    args = ["build", str(full_v41), "--sparks", "1", "--context", "1M", "--streams", "32", "--tokens", str(ids),
            "--out", str(out)]
    assert main(args) == 2
    assert "does not fit 1 Spark at 1,048,576 tokens x 32 streams (exllamav3-v41)" in capsys.readouterr().err
    assert not (tmp_path / "pack.work" / "calibration").exists() and not out.exists()
