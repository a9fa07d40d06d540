"""`WORK/job.json`: what a work directory was started with, so a rerun continues only the same job.

A job is its source (by fingerprint, not path: a moved checkpoint is the same checkpoint), its plan
(hash plus the full K map, so a difference can be named per tensor) and its settings (seed, device,
encoder, calibration, tool version). Any difference refuses the resume with one line per field.
The work directory's other guards live here too: one job at a time (a lock the kernel releases however
its holder dies), enough free disk checked up front, and JSON written atomically.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from quantizer.errors import UserError
from quantizer.report import GIB

JOB_NAME = "job.json"
LOCK_NAME = ".lock"
SHOWN_KEYS = 3


@dataclass(frozen=True)
class JobSpec:
    source: dict  # path, revision, fingerprint
    plan: dict  # hash, K (EXL3 key -> K or None), and the plan's other fields
    settings: dict  # seed, device, encoder, calibration, quantizer_version


def write_json_atomic(path: Path, data) -> None:
    """JSON to a temporary name, fsynced, then renamed: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def require_free_space(path: Path, need: int, what: str) -> None:
    """Refuse up front rather than fail hours later on a full disk."""
    free = shutil.disk_usage(path).free
    if need > free:
        raise UserError(f"{path}: {what} needs {need / GIB:,.2f} GiB but only {free / GIB:,.2f} GiB are free; "
                        "free some space or choose another location")


@contextmanager
def job_lock(work: Path):
    """One process per work directory; the kernel drops the lock when its holder dies, even by SIGKILL."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / LOCK_NAME, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{work}: another quantizer job is running in this work directory; wait for it or stop it")
        yield


def open_job(work: Path, spec: JobSpec) -> bool:
    """Start a job in `work`, or check that it continues the recorded one; True when resuming."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / JOB_NAME
    if not path.exists():
        if any(p.name != LOCK_NAME and not p.name.endswith(".tmp") for p in work.iterdir()):
            raise UserError(f"{work}: not empty but has no {JOB_NAME}, so its contents cannot be trusted; "
                            "delete it or choose another --work directory")
        write_json_atomic(path, asdict(spec))
        return False
    try:
        old = JobSpec(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise UserError(f"{path}: unreadable job file ({e}); delete the work directory to start over")
    differences = job_differences(old, spec)
    if differences:
        raise UserError(
            f"{work}: cannot resume a different job: " + "; ".join(differences)
            + ". Rerun with the original settings, or use a new --work directory"
        )
    return True


def job_differences(old: JobSpec, new: JobSpec) -> list[str]:
    out = []
    if old.source.get("fingerprint") != new.source.get("fingerprint"):
        out.append(f"source fingerprint differs: {old.source.get('fingerprint')} vs {new.source.get('fingerprint')}")
    out += _plan_differences(old.plan, new.plan)
    for field in sorted(old.settings.keys() | new.settings.keys()):
        a, b = old.settings.get(field), new.settings.get(field)
        if a != b:
            out.append(f"{field} differs: {a} -> {b}")
    return out


def _plan_differences(old: dict, new: dict) -> list[str]:
    if old.get("hash") == new.get("hash"):
        return []
    out = []
    old_k, new_k = old.get("K", {}), new.get("K", {})
    changed = [k for k in sorted(old_k.keys() | new_k.keys()) if old_k.get(k, "absent") != new_k.get(k, "absent")]
    for key in changed[:SHOWN_KEYS]:
        out.append(f"plan differs: {key} K {_k(old_k, key)} -> {_k(new_k, key)}")
    if len(changed) > SHOWN_KEYS:
        out.append(f"plan differs: {len(changed) - SHOWN_KEYS} more tensors change K")
    for field in sorted((old.keys() | new.keys()) - {"hash", "K"}):
        if old.get(field) != new.get(field):
            out.append(f"plan differs: {field} {_short(old.get(field))} -> {_short(new.get(field))}")
    return out or [f"plan differs: hash {old.get('hash')} -> {new.get('hash')}"]


def _k(ks: dict, key: str) -> str:
    if key not in ks:
        return "absent"
    return "native" if ks[key] is None else f"{ks[key]:g}"


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
