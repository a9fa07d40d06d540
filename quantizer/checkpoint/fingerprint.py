"""A cheap identity for a source checkpoint: what every resumable stage compares before continuing.

It hashes config.json, each shard's name and header (the 8-byte length and the JSON), and three
64 KiB samples of each shard's payload (first, middle, last). Headers pin every tensor's name, dtype,
shape and offset; the samples tell apart checkpoints with the same layout but other weights (another
seed, a fine-tune of the same shape). A 500 GB checkpoint is fingerprinted in well under a second.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError

SAMPLE_BYTES = 64 << 10


def source_fingerprint(ck: Checkpoint) -> str:
    """`sha256:<hex>` over config.json, then every shard (by name): name, header, payload samples."""
    return files_fingerprint(ck.root / "config.json", ck.shards)


def files_fingerprint(config: Path, shards: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(b"config.json\0")
    h.update(Path(config).read_bytes())
    for shard in sorted(shards, key=lambda p: p.name):
        h.update(b"\0" + shard.name.encode() + b"\0")
        _hash_shard(h, shard)
    return "sha256:" + h.hexdigest()


def _hash_shard(h, shard: Path) -> None:
    fd = os.open(shard, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise UserError(f"{shard}: not a safetensors file; re-download it")
        (n,) = struct.unpack("<Q", head)
        body = os.pread(fd, n, 8)
        if len(body) != n:
            raise UserError(f"{shard}: header is truncated; re-download this shard")
        h.update(head + body + struct.pack("<Q", size))
        start = 8 + n
        span = max(size - start, 0)
        for at in sorted({start, start + max(span - SAMPLE_BYTES, 0) // 2, start + max(span - SAMPLE_BYTES, 0)}):
            h.update(os.pread(fd, SAMPLE_BYTES, at))
    finally:
        os.close(fd)
