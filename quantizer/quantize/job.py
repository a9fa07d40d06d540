"""`WORK/job.json`: what a work directory was started with, so a rerun continues only the same job.

A job is its source (by fingerprint, not path: a moved checkpoint is the same checkpoint), its plan
(hash plus the full K map, so a difference can be named per tensor) and its settings (seed, device,
encoder, calibration, tool version). Any difference refuses the resume with one line per field;
the guard that applies it (lock, job file, free disk) is quantizer/workdir.py's, as for calibration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantizer.workdir import settings_differences, source_difference

SHOWN_KEYS = 3


@dataclass(frozen=True)
class JobSpec:
    source: dict  # path, revision, fingerprint
    plan: dict  # hash, K (EXL3 key -> K or None), and the plan's other fields
    settings: dict  # seed, device, encoder, calibration, quantizer_version


def job_differences(old: dict, new: dict) -> list[str]:
    """What differs between two job records (JobSpec as dicts), one line per field."""
    return (source_difference(old["source"], new["source"]) + _plan_differences(old["plan"], new["plan"])
            + settings_differences(old["settings"], new["settings"]))


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
