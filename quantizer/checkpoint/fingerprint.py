"""A source checkpoint's content identity: what every resumable stage compares before continuing, and
what a pack's manifest records so `ppl --against` can tell its source from another checkpoint.

It is the sha256 of config.json, the index and every shard's whole content, so one changed byte
anywhere changes it. Hashing reads each shard once (several shards at a time, one thread per core:
sha256 runs at about 1 GiB/s per core, so the read runs at disk speed; for V4.1-Flash's 510 GB a
few minutes at NVMe speed, once). Each shard's hash is kept with the work directory
(`source.json`) beside its size, modification time and file identity (device, inode); a rerun
rehashes only the shards where one of those moved. Not the change time (ctime): the kernel also
sets it when a hard link is added or removed, and a pack hard-links the source shards it keeps
unchanged (the Engram tables, up to 189 GiB), so a ctime key would rehash them after every build
(docs/filesystem.md). A write sets the modification time; a file replaced by another (rsync,
a download) has a new inode. A moved checkpoint (the same files renamed within one filesystem)
keeps its identity; a copy is rehashed once.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from quantizer.caches import ProcessStore
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.workdir import read_json, write_json_atomic

HASH_CHUNK = 16 << 20
_HASHED = ProcessStore(maxsize=4096)  # (path, stat key) -> sha256: a real model has ~60 shards


def source_fingerprint(ck: Checkpoint, cache: Path | None = None, borrow: Path | None = None) -> str:
    """`sha256:<hex>` over config.json, the index and every shard (by name); `cache` is the JSON file
    that keeps shard hashes between runs (none: hashes last only as long as the process); `borrow` is
    another process's cache, read only: its hashes serve the shards whose size and times it records
    (another rank of the job on the same host reading the same files)."""
    return files_fingerprint(ck.root, ck.shards, cache, borrow)


def layout_fingerprint(ck: Checkpoint) -> str:
    """config.json, the index and every shard's name and size, read in milliseconds: what the ranks of a
    distributed build compare first; then each hashes the content it reads (orchestrate/source_guard.py)."""
    h = hashlib.sha256()
    for name in ("config.json", INDEX_NAME):
        if (ck.root / name).exists():
            h.update(name.encode() + b"\0" + (ck.root / name).read_bytes() + b"\0")
    for s in sorted(ck.shards, key=lambda s: s.name):
        h.update(f"{s.name}\0{s.stat().st_size}\0".encode())
    return "layout-sha256:" + h.hexdigest()


def files_fingerprint(root: Path, shards: list[Path], cache: Path | None = None, borrow: Path | None = None) -> str:
    record = shard_records(shards, cache, borrow)
    h = hashlib.sha256()
    for name in ("config.json", INDEX_NAME):
        if (root / name).exists():
            h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for name in sorted(record):
        h.update(f"{name}\0{record[name]['size']}\0{record[name]['sha256']}\0".encode())
    return "sha256:" + h.hexdigest()


def shard_records(shards: list[Path], cache: Path | None = None, borrow: Path | None = None) -> dict[str, dict]:
    """name -> {size, mtime_ns, dev, inode, sha256} of each shard; a digest this process, `cache` or `borrow`
    already holds for the same file (its stat key) is reused, the rest are hashed in parallel."""
    known, borrowed = _load(cache), _load(borrow)
    keys = {s.name: (str(s.resolve()), *_stat_key(s)) for s in shards}  # taken before any read
    digests = {}  # this call's own: the process cache is bounded and may drop an entry while it runs
    for s in shards:
        key = keys[s.name]
        digest = _HASHED.get(key) or _cached(known, s.name, key[1:]) or _cached(borrowed, s.name, key[1:])
        if digest:
            digests[key] = digest
    digests.update(_hash_all([(s, keys[s.name]) for s in shards if keys[s.name] not in digests]))
    for key, digest in digests.items():  # what the caches vouch for also serves later calls in this process
        _HASHED[key] = digest
    record = {}
    for s in shards:
        size, mtime, dev, ino = keys[s.name][1:]
        record[s.name] = {"size": size, "mtime_ns": mtime, "dev": dev, "inode": ino, "sha256": digests[keys[s.name]]}
    if cache is not None and record != known:
        write_json_atomic(cache, record)
    return record


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    """What a shard's cached hash is kept under: size, modification time, device and inode (no ctime,
    which a hard link changes: see the module docstring)."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino


def _load(cache: Path | None) -> dict:
    if cache is None or not cache.exists():
        return {}
    data = read_json(cache, "missing", f"delete {cache} (the shards are then hashed again)")
    return data if isinstance(data, dict) else {}


def _cached(known: dict, name: str, key: tuple[int, int, int, int]) -> str | None:
    entry = known.get(name)
    if isinstance(entry, dict) and (entry.get("size"), entry.get("mtime_ns"), entry.get("dev"), entry.get("inode")) == key:
        return entry.get("sha256")
    return None


def _hash_all(todo: list[tuple[Path, tuple]]) -> dict[tuple, str]:
    """Hash shards in parallel; each digest is filed under the stat key taken before it was read, so a
    shard written meanwhile no longer matches and is hashed again next time."""
    if not todo:
        return {}
    with tqdm(total=sum(key[1] for _, key in todo), unit="B", unit_scale=True, desc="fingerprint") as bar, \
            ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
        return {key: digest for (_, key), digest in zip(todo, pool.map(lambda item: sha256_file(item[0], bar.update), todo))}


def sha256_file(path: Path, progress=None) -> str:
    """Hex sha256 of a file, read in chunks; `progress(n)` is called with each chunk's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)  # releases the GIL, so files hash in parallel threads
            if progress:
                progress(len(chunk))
    return h.hexdigest()
