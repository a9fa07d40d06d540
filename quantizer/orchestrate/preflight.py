"""What `build` checks and claims before any expensive stage, so a mistake costs seconds, not a day.

- a plan given with `--plan` (made elsewhere, perhaps edited by hand) keeps every rule `make_plan`
  keeps for its own: a K for every target and none for a tensor the model lacks, EXL3 rates only,
  the source's architecture, and its loader profile; a fault names the tensor and the plan file;
- `--work` and `--out` are different places, neither inside the other;
- free space: the pack on `--out`'s filesystem, the calibration and quantized results on `--work`'s
  (both on one filesystem: the sum), estimated from the plan the request makes (see `DiskNeeds`);
- the work directory is claimed (quantizer/workdir.py: never a directory of the user's) and locked
  from the first write to the last rename;
- the pack is written in `<out>.partial-<job id>`, the job's own name: another build's temporary
  directory, or a `<out>.partial` of the user's, is never touched. While a build holds its partial
  directory (an flock on `<out>.partial-<job id>.lock` beside it), a second build into the same
  `--out` is refused at once.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import check_plan
from quantizer.errors import UserError
from quantizer.pack.writer import discard_partial, side_files
from quantizer.report import size_text
from quantizer.workdir import claim_work_dir, existing_parent, free_bytes, job_lock, lock_file

# Per pack tensor, beyond its bytes: the 64-byte alignment pad, its shard header entry and its lines in
# the index, the manifest and quantization_config.json; measured at 554 bytes on a tiny V4.1 pack.
TENSOR_OVERHEAD = 1024
LOCK_SUFFIX = ".lock"  # <out>.partial-<job id>.lock: the build writing that partial directory holds it
JSON_BYTES = 1 << 20  # config.json, quantization_config.json and the manifest's fixed parts


@dataclass(frozen=True)
class DiskNeeds:
    pack: int  # stored tensors + per-tensor headers, pads and JSON + the source's side files
    work: int  # calibration files + the quantized results, less what the work directory already holds

    def describe(self, out: Path, work: Path) -> str:
        return f"build: needs ~{size_text(self.pack)} for {out} and ~{size_text(self.work)} more in {work}"


def disk_needs(ck: Checkpoint, plan: Plan, calibration_disk: int, work: Path) -> DiskNeeds:
    stored = pack_spec(ck.config, plan).tensors
    side = sum(f.stat().st_size for f in side_files(ck.root))
    pack = sum(t.nbytes for t in stored) + TENSOR_OVERHEAD * len(stored) + JSON_BYTES + side
    results = sum(t.nbytes for t in stored if t.linear is not None)
    held = sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) if work.is_dir() else 0
    return DiskNeeds(pack, max(0, calibration_disk + results + TENSOR_OVERHEAD * len(stored) - held))


def check_given_plan(ck: Checkpoint, plan: Plan, where: str) -> None:
    """UserError naming `where` (the plan file) when `plan` is not one make_plan would have made for this
    checkpoint; before any stage, so nothing is written and no hour is spent on a plan the pack would break."""
    try:
        check_plan(ck.config, plan)
    except UserError as e:
        raise UserError(f"{where}: {e}; fix the plan or write it again with `quantizer plan`") from None


def check_places(out: Path, work: Path) -> None:
    """UserError when --work and --out are one directory, or one holds the other."""
    a, b = out.absolute().resolve(), work.absolute().resolve()
    if a == b or a in b.parents or b in a.parents:
        raise UserError(f"--work {work} and --out {out} must be separate directories (neither inside the other): "
                        "the pack is renamed into place at the end, the work directory is kept")


def check_space(out: Path, work: Path, needs: DiskNeeds) -> None:
    """Refuse before any work when the pack or the work directory cannot fit where it goes."""
    print(needs.describe(out, work), file=sys.stderr)
    same = os.stat(existing_parent(out)).st_dev == os.stat(existing_parent(work)).st_dev
    wanted = [(out, needs.pack + (needs.work if same else 0), "the pack" + (" and the work directory" if same else ""))]
    if not same:
        wanted.append((work, needs.work, "the work directory"))
    for where, need, what in wanted:
        free = free_bytes(where)
        if need > free:
            raise UserError(f"{existing_parent(where)}: {what} needs ~{size_text(need)} but only {size_text(free)} "
                            "are free; free some space or choose another --out / --work")


@contextmanager
def claim(out: Path, work: Path) -> Iterator[Path]:
    """Hold the work directory and this job's partial pack directory for the whole build; yields the
    partial directory (empty), which is removed again unless the pack stage renamed it to `out`.
    The partial directory is held by an flock on the regular file beside it, `<partial>.lock`
    (a directory cannot be locked on NFS: docs/filesystem.md)."""
    job = claim_work_dir(work)
    with job_lock(work):
        partial = out.with_name(f"{out.name}.partial-{job}")
        lock = partial.with_name(partial.name + LOCK_SUFFIX)
        partial.parent.mkdir(parents=True, exist_ok=True)  # where the pack goes (made here before, too)
        fd = lock_file(lock, f"{out}: another build is writing this pack (in {partial.name}); wait for it "
                             "to finish or choose another --out")
        try:
            discard_partial(partial)  # this job's own, left by a kill: nothing in it is reused
            partial.mkdir(parents=True)
            _refuse_other_writers(out, partial)
            yield partial
        finally:
            discard_partial(partial)  # and its Engram sibling, unless the pack stage renamed them into place
            lock.unlink(missing_ok=True)
            os.close(fd)


def _refuse_other_writers(out: Path, ours: Path) -> None:
    for other in sorted(out.parent.glob(f"{out.name}.partial-*")):
        if other == ours or not other.is_dir():
            continue
        try:  # a partial directory whose lock file is gone or unheld was left by a build that stopped
            os.close(lock_file(other.with_name(other.name + LOCK_SUFFIX),
                               f"{out}: another build is writing this pack (in {other.name}); wait for it to "
                               "finish or choose another --out", shared=True))
        except FileNotFoundError:
            pass
