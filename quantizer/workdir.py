"""Work-directory guards every stage uses: one job per directory at a time (a lock the kernel
releases however its holder dies), free disk checked before hours of work, JSON written atomically
and read back with one clear line for a missing or broken file."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from quantizer.errors import UserError
from quantizer.report import GIB

LOCK_NAME = ".lock"


def write_json_atomic(path: Path, data) -> None:
    """JSON to a temporary name, fsynced, then renamed: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, missing: str, hint: str = ""):
    """The JSON in `path`; UserError "<path>: <missing>" when there is no such file, and one naming
    the line when it is not JSON (`hint` says what to do about it)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: {missing}")
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})" + (f"; {hint}" if hint else ""))


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
