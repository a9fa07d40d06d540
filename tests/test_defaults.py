"""What a newcomer gets without asking (issue 61): the commands that run the model run on CUDA where torch
sees a GPU, else on the CPU, and say so in their help; `build`'s --device and --encoder help say the same
about what runs on cuda; `plan` names the allocator it used, and why, before the plan."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import build_parser, main, parse
from quantizer.plan.exl3_baseline import HQ
from quantizer.plan.sensitivity import synthetic_summary
from quantizer.shipped import model_config_path

DEVICE_ARGV = {  # the least each command that takes --device parses
    "build": ["build", "SRC", "--bpw", "2.9", "--out", "PACK"],
    "calibrate": ["calibrate", "SRC"],
    "ppl": ["ppl", "MODEL", "--text", "heldout"],
    "eval": ["eval", "PACK", "--tasks", "arc_easy"],
}
DEFAULT_HELP = "(default: cuda where a CUDA GPU is visible, else cpu)"
SMALL = str(model_config_path("small-v41.json"))


def _option(command: str, flag: str) -> argparse.Action:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if flag in a.option_strings)


@pytest.mark.parametrize("command", DEVICE_ARGV)
@pytest.mark.parametrize("visible, device", [(True, "cuda"), (False, "cpu")])
def test_device_defaults_to_cuda_where_a_gpu_is_visible(command, visible, device, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # build's --out is checked while parsing: a fresh directory has no PACK
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    assert parse(build_parser(), DEVICE_ARGV[command]).device == device
    assert _option(command, "--device").help.endswith(DEFAULT_HELP)


@pytest.mark.parametrize("command", DEVICE_ARGV)
@pytest.mark.parametrize("given", ["cpu", "cuda"])
def test_a_given_device_is_kept_and_cuda_is_not_asked(command, given, monkeypatch, tmp_path):
    def asked():
        raise AssertionError("torch.cuda.is_available called although --device was given")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert parse(build_parser(), [*DEVICE_ARGV[command], "--device", given]).device == given


@pytest.mark.parametrize("command", DEVICE_ARGV)
def test_an_unknown_device_is_refused_with_the_choices(command, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        parse(build_parser(), [*DEVICE_ARGV[command], "--device", "gpu"])
    assert stop.value.code == 2
    assert "--device: invalid choice: 'gpu' (choose from 'cpu', 'cuda')" in capsys.readouterr().err


def test_builds_device_and_encoder_help_say_the_same_of_what_runs_on_cuda():
    device, encoder = _option("build", "--device").help, _option("build", "--encoder").help
    for said in ("exllamav3's conversion steps", "our batch loop with our tile-search kernel", "exllamav3's own conversion"):
        assert said in device and said in encoder, said
    assert "(--encoder ours)" in device and "(--encoder exllamav3)" in device and "(ours, default" in encoder


def _plan(capsys, *flags: str) -> tuple[str, str]:
    capsys.readouterr()
    assert main(["plan", "--model-config", SMALL, "--bpw", "2.9", *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_plan_without_a_calibration_says_it_fell_back_to_uniform_and_how_to_get_ours(capsys):
    out, err = _plan(capsys)
    assert err.splitlines()[0] == (
        "allocator: uniform K (no --calibration or --synthetic given, so no sensitivities to allocate by; "
        "add --synthetic for ours on a synthetic calibration, or --calibration WORK for ours on a real one)")
    assert out.startswith("a uniform 2.9 bpw plan")
    out, err = _plan(capsys, "--method", "uniform", "--synthetic")  # asked for: no fallback, the summary unused
    assert err.splitlines()[0] == "allocator: uniform K (--method uniform); --synthetic is not used"


def test_plan_names_the_calibration_ours_allocated_on(capsys, tmp_path):
    out, err = _plan(capsys, "--synthetic", "--seed", "4")
    assert err.splitlines()[0].startswith("allocator: ours, on a synthetic calibration summary (--synthetic, seed 4): "
                                          "plausible sensitivities, not measured ones")
    assert out.startswith("our allocator's 2.9 bpw plan")
    measured = replace(synthetic_summary(ModelConfig.from_file(SMALL)), synthetic=False, rows=37, cols=2048)
    path = measured.save(tmp_path / "summary.json")
    out, err = _plan(capsys, "--calibration", str(path))
    assert err.splitlines()[0] == (f"allocator: ours, on the calibration summary {path} "
                                   "(37 rows x 2048 tokens, stream-energy site gains)")


def test_plan_says_exl3_reads_no_calibration_and_keeps_json_stdout_clean(capsys):
    out, err = _plan(capsys, "--method", "exl3", "--loader", "exllamav3", "--synthetic", "--json")
    assert err.splitlines()[0] == (f"allocator: exl3, exllamav3's own create_q_strategy (-hq {HQ}), which reads no "
                                   "calibration; --synthetic is not used")
    assert json.loads(out)["made_by"].startswith("exllamav3.create_q_strategy(")
