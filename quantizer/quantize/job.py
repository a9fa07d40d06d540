"""`WORK/job.json`: what a work directory was started with, so a rerun continues only the same job.

A job is its source (by fingerprint, not path: a moved checkpoint is the same checkpoint), its plan
(hash plus the full K map, so a difference can be named per tensor) and its settings (seed, device,
encoder, calibration, tool version). Any difference refuses the resume with one line per field.
The directory's other guards (lock, free disk, atomic JSON) are in quantizer/workdir.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from quantizer.errors import UserError
from quantizer.workdir import LOCK_NAME, write_json_atomic

JOB_NAME = "job.json"
SHOWN_KEYS = 3


@dataclass(frozen=True)
class JobSpec:
    source: dict  # path, revision, fingerprint
    plan: dict  # hash, K (EXL3 key -> K or None), and the plan's other fields
    settings: dict  # seed, device, encoder, calibration, quantizer_version


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
