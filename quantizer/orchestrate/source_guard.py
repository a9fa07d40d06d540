"""The bytes a build reads: the same on every rank, and unchanged from its first stage to its pack.

Before any stage every rank hashes the checkpoint it reads (checkpoint/fingerprint.py: each shard once,
its hash kept in the work directory, so a rerun re-reads only shards whose size or times moved; rank 0
hashes first and the ranks on its host borrow its hashes) and the ranks compare the digests: two hosts
whose copies differ, or a rank given another copy with the same layout, are refused before anything
is encoded into the shared work directory.

Before each quantize unit is saved, the shards it was read from must still have the size and
modification time they had at the pin (two stats), so no unit read from changed bytes ever enters the
cache, even when the build is killed before it could notice more. After each stage that read the
source every rank checks the whole source again (a stat per shard while nothing changed, a re-hash of
a shard that did). When a copy changed, what this run made from it is deleted before the refusal: the
quantize units it encoded (and the job record, when this run started it), the blocks it tuned and, if
any of the calibration was computed in this run, the calibration. A rerun, even with the bytes put back,
therefore finds no encoding of the changed bytes in the cache.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from quantizer.calibrate.storage import CALIBRATION_DIR
from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.distributed import current
from quantizer.errors import UserError
from quantizer.quantize.results import RESULTS_DIR, SUFFIX
from quantizer.tune.store import TUNED_DIR
from quantizer.workdir import FINGERPRINT_CACHE, JOB_NAME, LOCK_NAME, TMP_SUFFIX


@dataclass(frozen=True)
class PinnedSource:
    """What this rank read when the build began: the fingerprint every rank agreed on, and the shards'
    size and times then (to name the shard that changed)."""

    ck: Checkpoint
    fingerprint: str
    cache: Path  # this rank's shard hashes
    borrow: Path | None  # rank 0's shard hashes (other ranks only)
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)  # shard name -> (size, mtime_ns)

    def moved(self) -> list[str]:
        """This rank's shards whose content changed since the pin; [] while the fingerprint holds. A
        change in config.json or the index (no shard moved) is named by the checkpoint directory."""
        if source_fingerprint(self.ck, self.cache, self.borrow) == self.fingerprint:
            return []
        return [s.name for s in self.ck.shards if _stat(s) != self.stats.get(s.name)] or [self.ck.root.name]


    def check_read(self, names: list[str]) -> None:
        """UserError when a shard holding one of the tensors `names` (those the source has) was written
        since the pin (its size or modification time moved): what was read from it is not to be kept."""
        shards = {self.ck.entry(n).path for n in names if n in self.ck}
        moved = sorted(p.name for p in shards if _stat(p) != self.stats.get(p.name))
        if moved:
            raise UserError(f"{self.ck.root}: {', '.join(moved)} changed while this build read it (its size or "
                            f"modification time moved); the unit read from it was not saved. Rerun once nothing "
                            "writes to the checkpoint: the units saved before are kept, and a source whose bytes "
                            "differ from the work directory's job is refused")


def pin_source(ck: Checkpoint, work: Path) -> PinnedSource:
    """Every rank's content fingerprint of `ck`, refused unless all equal rank 0's (call it holding the
    claimed work directory: the hashes are kept there)."""
    ranks = current()
    main_cache = work / FINGERPRINT_CACHE
    stats = {s.name: _stat(s) for s in ck.shards}  # taken before the read: a write meanwhile shows later
    first = ranks.on_main(lambda: source_fingerprint(ck, main_cache))
    if ranks.main:
        pin = PinnedSource(ck, first, main_cache, None, stats)
    else:
        cache = work / f"{Path(FINGERPRINT_CACHE).stem}.rank{ranks.rank}.json"
        pin = PinnedSource(ck, source_fingerprint(ck, cache, main_cache), cache, main_cache, stats)
    every = ranks.gather((pin.fingerprint, socket.gethostname(), str(ck.root)))
    for r, (digest, host, root) in enumerate(every[1:], 1):
        if digest != every[0][0]:
            raise UserError(f"rank {r} (host {host}) reads {root}, whose bytes differ from what rank 0 "
                            f"(host {every[0][1]}) reads in {every[0][2]} (fingerprint {digest} vs {every[0][0]}); "
                            "every rank must read the same checkpoint: copy it again or point every rank at one copy")
    return pin


@dataclass(frozen=True)
class StageOutputs:
    """What a stage directory held before this run's stage wrote to it, so what the run made can be
    told apart from what earlier runs made (and deleted alone)."""

    quantize: Path
    units: frozenset[str]  # unit files already in the cache
    had_job: bool  # the quantize job record existed
    calibration: dict[str, tuple[int, int]]  # calibration file -> (size, mtime_ns)
    tuned: frozenset[str]  # tuned block files already in WORK/tuned

    @classmethod
    def before(cls, work: Path, quantize: Path) -> "StageOutputs":
        results = quantize / RESULTS_DIR
        units = frozenset(p.name for p in results.glob("*" + SUFFIX)) if results.is_dir() else frozenset()
        return cls(quantize, units, (quantize / JOB_NAME).exists(), _files(work / CALIBRATION_DIR),
                   frozenset(_files(work / TUNED_DIR)))

    def discard_since(self, work: Path) -> str:
        """Delete what this run made from the source (rank 0); says what was deleted."""
        deleted = []
        results = self.quantize / RESULTS_DIR
        new = [p for p in results.glob("*" + SUFFIX) if p.name not in self.units] if results.is_dir() else []
        for p in new:
            p.unlink()
        if new:
            deleted.append(f"the {len(new)} unit(s) encoded in this run")
        if not self.had_job and (self.quantize / JOB_NAME).exists():
            (self.quantize / JOB_NAME).unlink()
        tuned = [work / TUNED_DIR / name for name in _files(work / TUNED_DIR) if name not in self.tuned]
        for p in tuned:  # the tuned files and the record of a stage that finished (store.finished)
            p.unlink()
        if files := [p for p in tuned if p.name.endswith(SUFFIX)]:
            deleted.append(f"the {len(files)} block(s) tuned in this run")
        if _files(work / CALIBRATION_DIR) != self.calibration:
            shutil.rmtree(work / CALIBRATION_DIR)
            deleted.append("the calibration (computed in this run, at least in part)")
        return "deleted " + " and ".join(deleted) if deleted else "nothing made in this run had to be deleted"


def require_unchanged(pin: PinnedSource, stage: str, outputs: StageOutputs, work: Path) -> None:
    """After a stage: UserError, on every rank, when any rank's source changed since the pin, once rank 0
    has deleted what this run made (it may have been read from the changed bytes)."""
    ranks = current()
    every = ranks.gather((pin.moved(), socket.gethostname(), str(pin.ck.root)))
    changed = [(r, moved, host, root) for r, (moved, host, root) in enumerate(every) if moved]
    if not changed:
        return
    what = ranks.on_main(lambda: outputs.discard_since(work))
    r, moved, host, root = changed[0]
    who = f" (rank {r}, host {host})" if ranks.joined else ""
    raise UserError(f"{root}{who}: {', '.join(moved)} changed while this build read it ({stage}); {what}. "
                    "Rerun once nothing writes to the checkpoint: the cached work of earlier runs is kept, and "
                    "a source whose bytes differ from the work directory's job is refused")


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """The stage's results by (size, mtime): its lock and shard-hash cache change on every run."""
    if not directory.is_dir():
        return {}
    return {str(p.relative_to(directory)): _stat(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in (LOCK_NAME, FINGERPRINT_CACHE) and not p.name.endswith(TMP_SUFFIX)}
