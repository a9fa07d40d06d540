"""Work-directory guards every resumable stage uses, one set of rules:

- a work directory is one the pipeline made: `--work` must be absent, empty, or hold `work.json`
  (written when the directory is claimed), so a directory of the user's is never written into;
- one job per directory at a time: an exclusive lock the kernel releases however its holder dies,
  held from the first write to the last rename;
- a stage's `job.json` pins what it was started with; a rerun continues only the same job and is
  refused otherwise, with every difference named;
- free disk is checked before hours of work, and refused (not warned about) when short;
- JSON is written atomically and read back with one clear line for a missing or broken file.

The claimed directory's job id names the job's temporary files outside it (`<out>.partial-<id>`),
so two jobs never share, or delete, one another's temporary files. A distributed job is meant to
share one work directory this way: rank 0 claims it and holds the lock for the whole job; the
other ranks take the job id from `work.json` and write only into the stage directories, never
taking the lock themselves.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from quantizer.errors import UserError
from quantizer.report import size_text

LOCK_NAME = ".lock"
JOB_NAME = "job.json"
WORK_MARKER = "work.json"
FINGERPRINT_CACHE = "source.json"  # quantizer/checkpoint/fingerprint.py keeps its shard hashes here
TMP_SUFFIX = ".tmp"


def write_text_atomic(path: Path, text: str) -> None:
    """`text` to a temporary name beside `path`, fsynced, then renamed: a reader sees the old file or the
    new one, and a failed write (a full disk, Ctrl-C) leaves no temporary file behind."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data) -> None:
    """JSON written as write_text_atomic writes."""
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def read_text(path: str | os.PathLike, missing: str) -> str:
    """The text of the file `path`; one UserError line when there is no such file ("<path>: <missing>"), when it
    is a directory, unreadable, or not UTF-8 text (a binary file given for a recipe or a plan)."""
    path = Path(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: {missing}")
    except IsADirectoryError:
        raise UserError(f"{path}: a directory; give the file's path")
    except PermissionError:
        raise UserError(f"{path}: not readable (permission denied)")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file")


def read_json(path: str | os.PathLike, missing: str, hint: str = ""):
    """The JSON in `path`, read as read_text reads; one line naming the line when it is not JSON (`hint`
    says what to do about it)."""
    text = read_text(path, missing)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})" + (f"; {hint}" if hint else ""))


def output_problem(path: Path, directory: bool) -> str | None:
    """Why `path` cannot be written as a file (or, with `directory`, made as a directory), or None: a regular
    file where a parent directory must be (`--out notes.txt/pack`, `/etc/passwd/x`), or the path itself of the
    other kind. Checked where the path enters, before any work."""
    found = existing_parent(path)
    if found != Path(path).absolute():
        return None if found.is_dir() else f"{found} is a file, not a directory"
    if directory and not found.is_dir():
        return "a file; give a directory"
    if not directory and found.is_dir():
        return "a directory; give the file's path"
    return None


def existing_parent(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (where a directory still to be made will live)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def require_free_space(path: Path, need: int, what: str) -> None:
    """Refuse up front rather than fail hours later on a full disk."""
    free = free_bytes(path)
    if need > free:
        raise UserError(f"{path}: {what} needs {size_text(need)} but only {size_text(free)} are free; "
                        "free some space or choose another location")


def claim_work_dir(work: Path) -> str:
    """Make `work` a work directory (or check that it is one) and return its job id."""
    work = Path(work)
    marker = work / WORK_MARKER
    if work.exists() and not work.is_dir():
        raise UserError(f"{work}: exists and is not a directory; choose another --work")
    if work.is_dir() and not marker.exists() and any(work.iterdir()):
        raise UserError(f"{work}: an existing directory that is not a quantizer work directory (no {WORK_MARKER}); "
                        "nothing was written to it: choose a new or empty --work directory")
    if not marker.exists():
        work.mkdir(parents=True, exist_ok=True)
        write_json_atomic(marker, {"job": uuid.uuid4().hex[:12]})
    record = read_json(marker, "missing", f"delete {work} to start over")
    if not isinstance(record, dict) or not isinstance(record.get("job"), str):
        raise UserError(f"{marker}: not a work directory record; delete {work} to start over")
    return record["job"]


# errno values flock gives where the filesystem cannot lock (an NFS mount without a lock manager, FUSE).
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def lock_file(path: Path, busy: str, *, shared: bool = False) -> int:
    """An open descriptor of the regular file `path` holding an flock on it (exclusive: the file is
    created and opened for writing; shared: an existing file opened for reading), never waiting.
    A lock held elsewhere is UserError `busy`; a filesystem that cannot lock is one UserError line too.
    On NFS Linux emulates flock with POSIX byte-range locks, which need a regular file open for
    writing (exclusive) or reading (shared), so a directory cannot be locked there (docs/filesystem.md)."""
    try:
        fd = os.open(path, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        if shared:
            raise  # the caller's: nobody holds a lock file that is not there
        raise UserError(f"{path}: cannot create the lock file: its directory is gone") from None
    except OSError as e:
        raise UserError(f"{path}: cannot open the lock file ({e.strerror}); check the directory's permissions") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise UserError(busy) from None
        if e.errno in NO_LOCKS:
            raise UserError(f"{path}: this filesystem cannot lock files ({e.strerror}); put --work and --out on "
                            "a filesystem with file locking (local disk, or NFS with its lock service)") from None
        raise UserError(f"{path}: cannot lock ({e.strerror}); check the filesystem it is on") from None
    return fd


@contextmanager
def job_lock(work: Path) -> Iterator[None]:
    """One process per work directory; the kernel drops the lock when its holder dies, even by SIGKILL.
    The lock file is opened without truncating it, so a refused process never touches the holder's."""
    work.mkdir(parents=True, exist_ok=True)
    fd = lock_file(work / LOCK_NAME, f"{work}: another quantizer job is running in this work directory; "
                                     "wait for it or stop it")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for a person looking
        yield
    finally:
        os.close(fd)


def open_job(directory: Path, record: dict, differences: Callable[[dict, dict], list[str]], what: str) -> bool:
    """Start the job `record` in `directory`, or check that it continues the recorded one (`differences`
    names what changed); True when resuming. Call it holding the directory's lock."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / JOB_NAME
    if not path.exists():
        if any(p.name not in (LOCK_NAME, FINGERPRINT_CACHE) and not p.name.endswith(TMP_SUFFIX)
               for p in directory.iterdir()):
            raise UserError(f"{directory}: not empty but has no {JOB_NAME}, so its contents cannot be trusted; "
                            "delete it or choose another --work directory")
        write_json_atomic(path, record)
        return False
    old = read_json(path, "missing", f"delete {directory} to start over")
    try:
        found = differences(old, record)
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path}: unreadable {what} job ({type(e).__name__}: {e}); delete {directory} to start over")
    if found:
        raise UserError(f"{directory}: cannot resume a different {what}: " + "; ".join(found)
                        + ". Rerun with the original inputs and settings, or use a new --work directory")
    return True


def settings_differences(old: dict, new: dict) -> list[str]:
    """`<field> differs: a -> b` for every setting that changed."""
    return [f"{k} differs: {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def source_difference(old: dict, new: dict) -> list[str]:
    a, b = old.get("fingerprint"), new.get("fingerprint")
    return [] if a == b else [f"source fingerprint differs: {a} vs {b}"]
