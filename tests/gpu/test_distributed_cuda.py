"""`quantizer build --device cuda` under torchrun on one GPU (run on the GPU machine:
`python -m pytest tests/gpu/test_distributed_cuda.py -q`): a one-rank torchrun job joins an NCCL
group (calibration's Hessians and counts reduced over NCCL, control over gloo) and builds the same
pack, byte for byte, as the plain one-process command; a second run on a work directory whose
quantize stage was interrupted finishes it into the same pack."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantizer.quantize.results import RESULTS_DIR
from quantizer.shipped import shipped

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = str(shipped("small_model"))
ARGS = ["build", SMALL, "--bpw", "2.5", "--calib-rows", "8", "--calib-cols", "256", "--row-chunk", "2",
        "--device", "cuda"]
TORCHRUN = Path(sys.executable).with_name("torchrun")
REPO = Path(__file__).parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _plain(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantizer", *args], env=_env(), capture_output=True, text=True)


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(TORCHRUN), "--nproc-per-node", "1", "-m", "quantizer", *args], env=_env(),
                          capture_output=True, text=True)


def _files(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


def test_a_one_gpu_torchrun_job_builds_the_plain_commands_pack_and_resumes_it(tmp_path):
    plain = _plain(ARGS + ["--out", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr[-3000:]
    ranked = _torchrun(ARGS + ["--out", str(tmp_path / "ranked")])
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    assert _files(tmp_path / "ranked") == _files(tmp_path / "plain")

    # the plain run's work directory with half its units removed: torchrun finishes it
    work = tmp_path / "plain.work"
    results = sorted((work / "quantize" / RESULTS_DIR).glob("*.safetensors"))
    for path in results[::2]:
        path.unlink()
    shutil.rmtree(tmp_path / "plain")
    again = _torchrun(ARGS + ["--out", str(tmp_path / "again"), "--work", str(work)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(tmp_path / "again") == _files(tmp_path / "ranked")
