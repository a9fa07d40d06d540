"""`quantizer build` under torchrun on the CPU (gloo): two ranks build the bundled model's pack
byte-identical to one process (calibration split over the ranks' row chunks, quantization over their
units); a rank killed mid-quantize leaves a work directory one process finishes into the same pack;
ranks that disagree on a setting, or do not share the work directory, are refused naming it.

The ranks start as a user starts them, `torchrun --nproc-per-node 2 -m quantizer build ...`, except where
a test needs a small launcher instead: one that can give one rank another argument (the only way to make
two ranks of one torchrun command disagree) and records each rank's pid (to kill one)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from quantizer import distributed
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.targets import ROUTED, targets
from quantizer.quantize.results import RESULTS_DIR
from quantizer.shipped import shipped

SMALL = str(shipped("small_model"))
# 4 rows in 2 chunks of 2: each rank runs one chunk through every layer. The plan quantizes the routed
# experts of layers 0-2 and one attention linear (10 units, 1.2 M weights): the CPU codec's time,
# not the distribution's, is what a whole-model plan would add.
QUANTIZED_LAYERS = (0, 1, 2)
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 600
LAUNCHER = """
import os, sys
from pathlib import Path
from quantizer.cli import main
rank = os.environ["RANK"]
Path(sys.argv[1], f"rank{rank}.pid").write_text(str(os.getpid()))
extra = sys.argv[3].split() if rank == "1" and sys.argv[3] else []
sys.exit(main(sys.argv[4:] + extra))
"""

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")


def torchrun(tmp: Path, args: list[str], rank1_extra: str = "", wait: bool = True, pids: bool = False):
    """`torchrun --nproc-per-node 2 -m quantizer args` on this host; with `rank1_extra` (appended to rank
    1's arguments) or `pids` (each rank writes tmp/rankN.pid), through LAUNCHER instead of `-m quantizer`."""
    program = ["-m", "quantizer"]
    if rank1_extra or pids:
        launcher = tmp / "launch.py"
        launcher.write_text(LAUNCHER)
        program = [str(launcher), str(tmp), "-", rank1_extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(29500 + os.getpid() % 1000), *program, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out


def pack_files(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


@contextmanager
def one_thread():
    """One torch thread, as torchrun gives each rank (OMP_NUM_THREADS=1): CPU float32 reductions (BLAS,
    sums, Cholesky) round by how they are split over threads, so only equal thread counts compare."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def build_args(tmp_path_factory):
    cfg = Checkpoint.open(SMALL).config
    k = {t.key: (2.0 if t.group == ROUTED and t.layer in QUANTIZED_LAYERS else None) for t in targets(cfg)}
    k["layers.0.attn.wq_a"] = 3.0
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(cfg, k).save(plan)
    return ["build", SMALL, "--plan", str(plan), "--calib-rows", "4", "--calib-cols", "128", "--row-chunk", "2"]


@pytest.fixture(scope="module")
def reference(build_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    with one_thread():
        assert main(build_args + ["--out", str(root / "pack")]) == 0
    return pack_files(root / "pack")


def test_two_ranks_build_the_pack_one_process_builds(build_args, reference, tmp_path):
    code, out = torchrun(tmp_path, build_args + ["--out", str(tmp_path / "pack")])
    assert code == 0, out
    assert out.count("verify: clean") == 1  # rank 0 alone packs, verifies and reports
    assert pack_files(tmp_path / "pack") == reference


def test_a_rank_killed_mid_quantize_leaves_work_one_process_finishes_into_the_same_pack(build_args, reference, tmp_path):
    work = tmp_path / "pack.work"
    results = work / "quantize" / RESULTS_DIR
    proc = torchrun(tmp_path, build_args + ["--out", str(tmp_path / "pack")], wait=False, pids=True)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(list(results.glob("*.safetensors"))) < 4:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "quantization never started"
            time.sleep(0.05)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not (tmp_path / "pack").exists()
    done = len(list(results.glob("*.safetensors")))
    with one_thread():
        assert main(build_args + ["--out", str(tmp_path / "pack")]) == 0
    assert len(list(results.glob("*.safetensors"))) > done
    assert pack_files(tmp_path / "pack") == reference


def test_ranks_that_disagree_on_a_setting_are_refused_naming_it(build_args, tmp_path):
    code, out = torchrun(tmp_path, build_args + ["--out", str(tmp_path / "pack")], rank1_extra="--seed 1")
    assert code != 0
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 2 and all("rank 1 disagrees with rank 0 on quantize.seed: 1 vs 0" in line
                                    for line in errors), out
    assert not [line for line in out.splitlines() if line.startswith("  File ") and "quantizer" in line], out
    assert not (tmp_path / "pack.work" / "calibration").exists()


def test_an_error_line_reaches_stderr_in_one_write(monkeypatch, tmp_path):
    """Ranks share one stderr: a line written in two pieces (text, then newline) can run into the other
    rank's line, as it did on CI. Each error line is one write that ends the line."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": lambda self, s: writes.append(s),
                                                              "flush": lambda self: None})())
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert len(writes) == 1 and writes[0].startswith("quantizer inspect: error: ") and writes[0].endswith("\n")
    assert writes[0].count("\n") == 1


def test_ranks_that_do_not_share_the_work_directory_are_refused(build_args, tmp_path):
    args = build_args + ["--out", str(tmp_path / "pack")]
    code, out = torchrun(tmp_path, args, rank1_extra=f"--work {tmp_path / 'elsewhere'}")
    assert code != 0
    assert "rank 1 (host " in out and "does not see the file rank 0 wrote there" in out, out
    assert not (tmp_path / "pack.work" / "calibration").exists()


def test_rank_0s_failure_is_one_line_on_the_other_ranks(monkeypatch):
    told = []

    def share(self, obj):
        if self.main:
            told.append(obj)
        return told[0]

    monkeypatch.setattr(distributed.Ranks, "share", share)
    rank0 = distributed.Ranks(0, 2, 0, control=object())
    rank1 = distributed.Ranks(1, 2, 0, control=object())

    def full_disk():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/shared/pack.partial-1/model-00001.safetensors")

    with pytest.raises(OSError) as own:  # rank 0 keeps its own error (the CLI prints it as one line)
        rank0.on_main(full_disk)
    assert own.value.errno == errno.ENOSPC
    with pytest.raises(UserError) as other:
        rank1.on_main(lambda: pytest.fail("only rank 0 runs it"))
    assert str(other.value) == ("rank 0 stopped: /shared/pack.partial-1/model-00001.safetensors: No space left on "
                                "device; its own output says more")
