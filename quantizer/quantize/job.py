"""`WORK/job.json`: what a quantize directory was started with, so only compatible jobs share it.

A job is its source (by fingerprint, not path: a moved checkpoint is the same checkpoint) and its
settings (seed, device, encoder, calibration, tool version). The plan is not part of it: the directory
is a cache of encodings keyed per unit (results.py), so any plan of the same source and settings may
use it. Any difference refuses with one line per field; the guard that applies it (lock, job file,
free disk) is quantizer/workdir.py's, as for calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantizer.workdir import settings_differences, source_difference


@dataclass(frozen=True)
class JobSpec:
    source: dict  # path, revision, fingerprint
    settings: dict  # seed, device, encoder, calibration, quantizer_version


def job_differences(old: dict, new: dict) -> list[str]:
    """What differs between two job records (JobSpec as dicts), one line per field."""
    return source_difference(old["source"], new["source"]) + settings_differences(old["settings"], new["settings"])
