"""Work directories and pack claims: locks are taken on regular files only, a filesystem that cannot lock
is one line, a second build into the same pack is refused, and a directory that is not a quantizer work
directory is neither written nor read."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import numpy as np
import pytest
from one_line import one_line

from quantizer import distributed, workdir
from quantizer.orchestrate.preflight import claim
from quantizer.orchestrate.stages import plan_files
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.targets import targets
from quantizer.quantize.results import RESULTS_DIR, SUFFIX


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EIO])
def test_a_filesystem_that_cannot_lock_is_one_line(tiny_v41, fp16_plan, tmp_path, monkeypatch, capsys, code):
    def refuse(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(workdir.fcntl, "flock", refuse)
    args = ["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(tmp_path / "pack"), "--no-calibrate"]
    assert main(args) == 2
    why = "this filesystem cannot lock files" if code != errno.EIO else "cannot lock (Input/output error)"
    one_line(capsys.readouterr().err, f"{tmp_path / 'pack.work' / workdir.LOCK_NAME}: {why}")
    assert not (tmp_path / "pack").exists()


def test_every_lock_is_taken_on_a_regular_file_and_the_partial_directorys_lock_refuses_a_second_build(tmp_path,
                                                                                                     monkeypatch):
    out = tmp_path / "pack"
    stale = tmp_path / "pack.partial-0123456789ab"  # left by a build that was killed: no lock held
    stale.mkdir()
    locked = []
    real = fcntl.flock

    def only_files(fd, op):
        assert stat.S_ISREG(os.fstat(fd).st_mode), "flock on something other than a regular file"
        locked.append(op)
        return real(fd, op)

    monkeypatch.setattr(workdir.fcntl, "flock", only_files)
    with claim(out, tmp_path / "first.work") as partial:
        lock = partial.with_name(partial.name + ".lock")
        assert lock.is_file() and len(locked) == 2  # the work directory's, then the partial directory's
        with pytest.raises(UserError, match="another build is writing this pack"):
            with claim(out, tmp_path / "second.work"):
                pass
    assert not partial.exists() and not lock.exists() and stale.is_dir()


def test_the_claim_makes_the_packs_parent_directory_before_locking_beside_it(tmp_path):
    out = tmp_path / "packs" / "pack"  # the demo's layout: packs/ does not exist yet
    with claim(out, tmp_path / "pack.work") as partial:
        assert partial.is_dir() and partial.with_name(partial.name + ".lock").is_file()


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A joined torch.distributed context of one rank (gloo), so the multi-rank code paths run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(distributed, "_current", distributed.Ranks(0, 1, 0, dist.new_group(backend="gloo")))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_shared_directory_check_writes_nothing_into_a_work_directory_it_was_refused(
        tiny_v41, fp16_plan, tmp_path, one_rank_group, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    os.utime(mine, ns=(10**18, 10**18))  # a file made and removed in mine from now on would move its mtime
    before = os.stat(mine).st_mtime_ns
    assert main(["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(tmp_path / "pack"), "--no-calibrate",
                 "--work", str(mine)]) == 2
    one_line(capsys.readouterr().err, "not a quantizer work directory")
    assert os.stat(mine).st_mtime_ns == before and [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_measured_errors_never_read_a_directory_that_is_not_a_work_directory(tiny_v41, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "quantize" / RESULTS_DIR).mkdir(parents=True)
    (mine / "quantize" / RESULTS_DIR / f"unit{SUFFIX}").write_bytes(b"not a safetensors file of ours")
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, 4096, size=(2, 16)))
    assert main(["build", str(tiny_v41), "--bpw", "2.5", "--out", str(tmp_path / "pack"), "--work", str(mine),
                 "--measured-errors", "--tokens", str(tokens)]) == 2
    one_line(capsys.readouterr().err, "not a quantizer work directory")


def test_builds_sharing_a_work_directory_keep_each_its_plan(tiny_v41, fp16_plan, tmp_path, capsys):
    """`build --help` suggests sharing --work between builds: the second build's plan must not replace the
    first's (WORK/plans/<pack name>/), and a plan replaced under the same pack name is said so."""
    cfg = Checkpoint.open(tiny_v41).config
    other = make_plan(cfg, {t.key: (16.0 if t.key.endswith("layers.0.attn.wkv") else None) for t in targets(cfg)})
    other.save(tmp_path / "other.json")
    work = tmp_path / "shared.work"
    for plan, out in ((fp16_plan, tmp_path / "a"), (tmp_path / "other.json", tmp_path / "b")):
        assert main(["build", str(tiny_v41), "--plan", str(plan), "--out", str(out), "--work", str(work),
                     "--no-calibrate"]) == 0
    assert "replacing" not in capsys.readouterr().err
    first, second = plan_files(work, tmp_path / "a"), plan_files(work, tmp_path / "b")
    assert Plan.load(first[0]).k == Plan.load(fp16_plan).k and Plan.load(second[0]).k == other.k
    assert first[1].is_file() and second[1].is_file() and first[1].read_text() != second[1].read_text()
    assert main(["build", str(tiny_v41), "--plan", str(tmp_path / "other.json"), "--out", str(tmp_path / "again" / "a"),
                 "--work", str(work), "--no-calibrate"]) == 0
    assert f"plan: replacing {first[0]}, an earlier build's other plan for a pack named a" in capsys.readouterr().err
    assert Plan.load(first[0]).k == other.k
