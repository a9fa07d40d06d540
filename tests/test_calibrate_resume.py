"""`quantizer calibrate` as a user runs it: killed and rerun it finishes with the same files as an
uninterrupted run; a rerun with other inputs or settings is refused naming the difference; bad input
is one clear line; the memory and disk it states match what it writes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quantizer.calibrate import CalibrationSettings, HessianStore, calibrate, calibration_needs
from quantizer.calibrate.storage import CALIBRATION_DIR, STREAMS_PREFIX, SUMMARY_FILE, layer_file
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.errors import UserError
from quantizer.model.targets import DRAFT, targets
from quantizer.shipped import model_config_path

TIMEOUT_S = 300
SLOW_LAYER_S = 0.3  # the killed run sleeps this long per layer, so the kill lands between layers
SMALL_MODEL = Path(__file__).resolve().parent.parent / "quantizer" / "small_model"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "rows.npy"
    np.save(path, np.random.default_rng(3).integers(3, 4096, size=(2, 16)))
    return path


@pytest.fixture(scope="module")
def finished(tiny_v41, tokens, tmp_path_factory):
    work = tmp_path_factory.mktemp("work") / "done"
    assert main(["calibrate", str(tiny_v41), "--tokens", str(tokens), "--work", str(work)]) == 0
    return work


def _files(work):
    return {p.name: p.read_bytes() for p in sorted((work / CALIBRATION_DIR).iterdir()) if p.name != ".lock"}


@pytest.mark.slow
def test_a_killed_calibration_resumes_to_identical_files(tiny_v41, tokens, finished, tmp_path):
    work = tmp_path / "killed"
    args = ["calibrate", str(tiny_v41), "--tokens", str(tokens), "--work", str(work)]
    slow = ("import sys, time; import quantizer.calibrate.stage as s; load = s.load_block; "
            f"s.load_block = lambda *a, **k: (time.sleep({SLOW_LAYER_S}), load(*a, **k))[1]; "
            "from quantizer.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", slow, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (work / CALIBRATION_DIR / layer_file(2)).exists():
            assert proc.poll() is None, "calibration ended before it could be killed"
            assert time.monotonic() < deadline, "calibration never reached layer 2"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (work / CALIBRATION_DIR / SUMMARY_FILE).exists()
    assert list((work / CALIBRATION_DIR).glob(STREAMS_PREFIX + "*"))
    with pytest.raises(UserError, match="calibration is not complete"):
        HessianStore(work, Checkpoint.open(tiny_v41))

    assert main(args + ["--resume-every", "3"]) == 0  # how often it saves changes no result
    resumed = _files(work)
    assert resumed == _files(finished)
    assert not any(name.startswith(STREAMS_PREFIX) for name in resumed)  # the resume point goes with the summary


def test_a_rerun_of_a_finished_calibration_says_it_reuses_it(tiny_v41, tokens, finished, tmp_path, capsys):
    work = tmp_path / "again"
    shutil.copytree(finished, work)
    capsys.readouterr()
    assert main(["calibrate", str(tiny_v41), "--tokens", str(tokens), "--work", str(work)]) == 0
    err = capsys.readouterr().err
    assert f"calibrate: reusing the finished calibration of 2 rows x 16 tokens in {work / CALIBRATION_DIR}" in err
    assert "calibrate needs" not in err and _files(work) == _files(finished)


def test_a_changed_source_tokens_or_setting_is_refused_naming_the_difference(tiny_v41, tiny_v4, tokens, finished,
                                                                             tmp_path, capsys):
    base = ["calibrate", str(tiny_v41), "--tokens", str(tokens), "--work", str(finished)]
    other = tmp_path / "other.npy"
    np.save(other, np.random.default_rng(4).integers(3, 4096, size=(2, 16)))
    cases = [
        (base + ["--no-all-experts"], "all_experts differs: True -> False"),
        (base + ["--prior-tokens", "64"], "prior_tokens differs: 512.0 -> 64.0"),
        (base + ["--rows", "1"], "rows differ: 2 -> 1"),
        (["calibrate", str(tiny_v41), "--tokens", str(other), "--work", str(finished)], "calibration tokens differ"),
        (["calibrate", str(tiny_v4), "--tokens", str(tokens), "--work", str(finished)], "source fingerprint differs"),
    ]
    for args, difference in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert "cannot resume a different calibration" in err and difference in err, (args, err)
    assert main(base) == 0  # the same command again: already complete, nothing rerun
    assert "calibrated" in capsys.readouterr().out
    with pytest.raises(UserError, match="another checkpoint"):
        HessianStore(finished, Checkpoint.open(tiny_v4))


def test_bad_input_is_one_clear_user_error(tiny_v41, tmp_path, capsys):
    short = tmp_path / "short.npy"
    np.save(short, np.arange(3, 40))
    text = tmp_path / "doc.txt"
    text.write_text("some text")
    cases = [
        (["--tokens", str(tmp_path / "missing.npy")], "file not found"),
        (["--tokens", str(short), "--rows", "4", "--cols", "16"], "give more text or ask for fewer rows"),
        (["--tokens", str(text)], "--tokens takes a .npy or .safetensors file"),
        (["--text", str(text)], "has no tokenizer.json"),
        (["--text", "heldout-test"], "heldout-test: no such file, and not a shipped text set"),
        ([], "has no tokenizer.json"),  # the shipped calibration set needs the model's tokenizer too
        (["--tokens", str(short), "--cols", "8", "--prior-tokens", "-1"], "--prior-tokens -1: must be 0 or more"),
    ]
    for extra, message in cases:
        assert main(["calibrate", str(tiny_v41), "--work", str(tmp_path / "w"), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, (extra, err)
    assert not (tmp_path / "w" / CALIBRATION_DIR / SUMMARY_FILE).exists()


def test_stated_disk_matches_the_files_written(tiny_v41, tokens, finished, capsys):
    cfg = Checkpoint.open(tiny_v41).config
    needs = calibration_needs(cfg, 2, 16, CalibrationSettings())
    written = sum(len(data) for name, data in _files(finished).items() if name.endswith(".safetensors"))
    headers = 11 * (16 << 10)  # the eleven files' safetensors headers (names, statistics) and alignment
    assert needs.layer_files <= written <= needs.layer_files + headers
    assert needs.resume_file > 0 and needs.device > needs.stream.total + needs.hessians
    line = needs.describe("cpu")
    assert "RAM" in line and "disk" in line


@pytest.mark.slow
def test_real_model_needs_are_bounded():
    """V4.1-Flash at 250 x 2048: the routed experts' Hessians dominate the disk; float16 halves them; the
    default's own gate/up Hessian per expert (gate2) still fits one H200, made one expert at a time."""
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    half = calibration_needs(cfg, 250, 2048, CalibrationSettings(device="cuda", expert_hessians="shared"))
    full = calibration_needs(cfg, 250, 2048, CalibrationSettings(device="cuda", expert_hessians="shared",
                                                                 expert_hessian_dtype="float32"))
    gib = 1 << 30
    assert 80 * gib < half.layer_files < 100 * gib < 2 * 80 * gib < full.layer_files < 2 * 100 * gib
    # fp32 hc streams of 512k tokens (39 GiB) + the forward state (index selections, compressed KV)
    assert 39 * gib < half.resume_file < 70 * gib
    assert half.device < 139 * gib  # one H200
    default = calibration_needs(cfg, 250, 2048, CalibrationSettings(device="cuda"))
    # 384 x 40 more float16 triangles of 5120: 393 GiB more on disk
    assert 450 * gib < default.layer_files < 500 * gib and default.resume_file == half.resume_file
    # the kept MoE inputs of 512k tokens (4.9 GiB of bf16), not 75 GiB of float64 sums
    assert half.device < default.device < half.device + 6 * gib < 139 * gib


def test_v4_checkpoint_calibrates_every_trunk_target(tiny_v4, tmp_path):
    ck = Checkpoint.open(tiny_v4)
    rows = torch.from_numpy(np.random.default_rng(5).integers(3, 4096, size=(2, 16)))
    result = calibrate(ck, rows, tmp_path, progress=False)
    store = HessianStore(tmp_path, ck)
    keys = [t.key for t in targets(ck.config) if t.group != DRAFT]
    assert set(result.summary.tensors) == set(keys)
    assert all(store.hessian(k) is not None for k in keys)
    k = ck.config.experts_per_token
    assert all(sum(layer.expert_tokens) == 2 * 16 * k for layer in result.summary.layers)


@pytest.mark.skipif(not (SMALL_MODEL / "config.json").exists(),
                    reason="the small bundled model's checkpoint is not in quantizer/small_model/ yet")
def test_small_bundled_model_calibrates_on_the_shipped_text(tmp_path, capsys):
    assert main(["calibrate", str(SMALL_MODEL), "--rows", "4", "--cols", "128", "--work", str(tmp_path)]) == 0
    store = HessianStore(tmp_path, Checkpoint.open(SMALL_MODEL))
    summary = store.summary()
    assert summary.rows == 4 and summary.cols == 128
    assert all(stats.out_energy > 0 and 0 < stats.ldlq_factor <= 1 for stats in summary.tensors.values())
