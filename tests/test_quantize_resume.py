"""Kill a build at any moment and rerun the same command: it continues, and the pack is byte-identical
to an uninterrupted run's. A rerun with another source or seed is refused, naming the difference;
another plan shares the encodings it has in common with the first."""

from __future__ import annotations

import pytest

import os
import shutil
import signal
import subprocess
import sys
import time

from quantizer.orchestrate.stages import QUANTIZE_DIR
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.quantize.results import RESULTS_DIR
from quantizer.tiny.make import make_tiny
from quantizer.workdir import JOB_NAME

FP16_KEYS = [f"layers.{layer}.attn.{p}" for layer in (0, 1) for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
# Last in stream order, four units (wo_a is two slices): the kill lands while they are being encoded.
ENCODED_KEYS = ("layers.9.attn.wq_b", "layers.9.attn.wo_a", "layers.9.attn.wo_b")
ENCODED_UNITS = 4
TIMEOUT_S = 300


def _plan(tiny, path, encoded: bool):
    cfg = Checkpoint.open(tiny).config
    k = {t.key: (16.0 if t.key in FP16_KEYS else None) for t in targets(cfg)}
    if encoded:
        k.update({key: 4.0 for key in ENCODED_KEYS})
    make_plan(cfg, k).save(path)
    return path


def _args(src, plan, out, *extra):
    return ["build", str(src), "--plan", str(plan), "--out", str(out), "--no-calibrate", *extra]


def _spawn(args):
    return subprocess.Popen([sys.executable, "-m", "quantizer.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(proc, ready):
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        assert proc.poll() is None, "the build ended too early"
        assert time.monotonic() < deadline, "the build never got far enough"
        time.sleep(0.05)


def _kill_when(proc, ready):
    """SIGKILL the build as soon as `ready()`; it is killed whatever happens, so no build outlives the test."""
    try:
        _wait_for(proc, ready)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _files(pack):
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


@pytest.mark.slow
def test_a_killed_build_resumes_to_a_byte_identical_pack(tiny_v41, tmp_path, capsys):
    plan = _plan(tiny_v41, tmp_path / "plan.json", encoded=True)
    assert main(_args(tiny_v41, plan, tmp_path / "reference")) == 0

    out = tmp_path / "pack"
    results = tmp_path / "pack.work" / QUANTIZE_DIR / RESULTS_DIR
    proc = _spawn(_args(tiny_v41, plan, out))
    _kill_when(proc, lambda: len(list(results.glob("*.safetensors"))) >= len(FP16_KEYS))
    assert not out.exists()
    finished = {p.name: p.stat().st_mtime_ns for p in results.glob("*.safetensors")}
    assert len(FP16_KEYS) <= len(finished) < len(FP16_KEYS) + ENCODED_UNITS  # killed with encoding left to do

    capsys.readouterr()
    assert main(_args(tiny_v41, plan, out)) == 0
    assert f"{len(finished)} already in the cache" in capsys.readouterr().err
    assert all(p.stat().st_mtime_ns == finished[p.name] for p in results.glob("*.safetensors") if p.name in finished)
    reference, resumed = _files(tmp_path / "reference"), _files(out)
    assert reference.keys() == resumed.keys()
    for name in reference:
        assert reference[name] == resumed[name], name


def test_a_result_that_cannot_be_read_back_is_redone(tiny_v41, tmp_path):
    plan = _plan(tiny_v41, tmp_path / "plan.json", encoded=False)
    assert main(_args(tiny_v41, plan, tmp_path / "reference")) == 0
    out = tmp_path / "pack"
    assert main(_args(tiny_v41, plan, out)) == 0
    damaged, = (tmp_path / "pack.work" / QUANTIZE_DIR / RESULTS_DIR).glob(f"{FP16_KEYS[3]}.*.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:100])
    shutil.rmtree(out)
    assert main(_args(tiny_v41, plan, out)) == 0
    assert _files(out) == _files(tmp_path / "reference")


def test_an_existing_pack_is_never_overwritten(tiny_v41, tmp_path, capsys):
    plan = _plan(tiny_v41, tmp_path / "plan.json", encoded=False)
    out = tmp_path / "pack"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(_args(tiny_v41, plan, out)) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and not (tmp_path / "pack.work").exists()


def test_a_rerun_with_another_seed_or_source_is_refused(tiny_v41, tmp_path, capsys):
    plan = _plan(tiny_v41, tmp_path / "plan.json", encoded=False)
    out = tmp_path / "pack"
    assert main(_args(tiny_v41, plan, out)) == 0
    shutil.rmtree(out)  # keep the work directory: the rerun meets its job file
    capsys.readouterr()
    assert main(_args(tiny_v41, plan, out, "--seed", "1")) == 2
    assert "seed differs: 0 -> 1" in capsys.readouterr().err
    other = make_tiny(tmp_path / "other", "v41", seed=1)
    assert main(_args(other, plan, out)) == 2
    err = capsys.readouterr().err
    assert "source fingerprint differs: sha256:" in err and " vs sha256:" in err


@pytest.mark.slow
def test_another_plan_in_the_same_work_directory_encodes_only_what_it_adds(tiny_v41, tmp_path):
    """The quantize directory is a cache: a second plan reuses the encodings it shares with the first
    (their files untouched), encodes only its own, and packs what a fresh directory would."""
    first, second = _plan(tiny_v41, tmp_path / "a.json", encoded=False), _plan(tiny_v41, tmp_path / "b.json", encoded=True)
    work = tmp_path / "shared.work"
    assert main(_args(tiny_v41, first, tmp_path / "a", "--work", str(work))) == 0
    results = work / QUANTIZE_DIR / RESULTS_DIR
    kept = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    assert main(_args(tiny_v41, second, tmp_path / "b", "--work", str(work))) == 0
    now = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    assert {name: now[name] for name in kept} == kept and len(now) == len(kept) + ENCODED_UNITS
    assert main(_args(tiny_v41, second, tmp_path / "fresh")) == 0
    assert _files(tmp_path / "b") == _files(tmp_path / "fresh")


def test_a_second_build_in_the_same_work_directory_is_refused_while_the_first_runs(tiny_v41, tmp_path, capsys):
    args = ["build", str(tiny_v41), "--bpw", "2.5", "--out", str(tmp_path / "pack"), "--method", "uniform", "--no-calibrate",
            "--loader", "exllamav3"]  # minutes of encoding
    proc = _spawn(args)
    try:
        _wait_for(proc, lambda: (tmp_path / "pack.work" / QUANTIZE_DIR / JOB_NAME).exists())
        assert main(args) == 2
        assert "another quantizer job is running" in capsys.readouterr().err
    finally:
        _kill_when(proc, lambda: True)
