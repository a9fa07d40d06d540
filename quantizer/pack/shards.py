"""Pack shards: which tensor goes in which file, and writing each file by copying bytes, never decoding.

Every tensor of a pack already exists byte for byte somewhere: native tensors in the source checkpoint,
EXL3 tensors in the work directory's result files. A shard is written as its header with holes
(`write_safetensors` with data=None, 64-byte aligned) and the holes are then filled by kernel-side
copies (`copy_file_range`), so packing a 300 GB model needs no RAM beyond one header.

Layout rules: tensors are grouped in units (the top-level tensors, each trunk layer, each drafter
block, the vision tower) that are never split across shards unless one alone exceeds the cap; each
Engram layer's table and scale get shards of their own, since they are read from NVMe row by row.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from quantizer.checkpoint.safetensors_file import PlannedTensor, TensorEntry, read_header, write_safetensors
from quantizer.errors import UserError
from quantizer.model.tensor_classes import ENGRAM_TABLE, VISION

ALIGN = 64
SHARD_METADATA = {"format": "pt"}
COPY_CHUNK = 1 << 30
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


@dataclass(frozen=True)
class PackTensor:
    """One tensor of the pack: its header entry, where its bytes are now, and what it is."""

    name: str
    source: TensorEntry  # bytes to copy: a source checkpoint tensor or a work-dir result tensor
    K: float | int | str  # EXL3 bits per weight of its linear, or "native"
    cls: str

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


@dataclass(frozen=True)
class ShardPlan:
    file: str
    tensors: tuple[PackTensor, ...]
    engram: bool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def unit_of(t: PackTensor) -> tuple:
    """The group a tensor is kept with, ordered: top-level, trunk layers, drafter blocks, vision, Engram."""
    m = _LAYER.match(t.name)
    if t.cls == ENGRAM_TABLE:
        return (4, int(m[2]) if m else 0)
    if t.cls == VISION:
        return (3, 0)
    if m:
        return (1 if m[1] == "layers" else 2, int(m[2]))
    return (0, 0)


def assign_shards(tensors: list[PackTensor], cap: int) -> list[ShardPlan]:
    """Units in order, greedily filled up to `cap` bytes; Engram units always start their own shard."""
    units: dict[tuple, list[PackTensor]] = {}
    for t in sorted(tensors, key=lambda t: (unit_of(t), t.name)):
        units.setdefault(unit_of(t), []).append(t)
    groups: list[tuple[list[PackTensor], bool]] = []
    for key, members in units.items():
        engram = key[0] == 4
        size = sum(_footprint(t) for t in members)
        open_group = groups[-1] if groups and not groups[-1][1] and not engram else None
        if open_group is not None and sum(_footprint(t) for t in open_group[0]) + size <= cap:
            open_group[0].extend(members)
        elif size <= cap:
            groups.append((list(members), engram))
        else:
            groups.extend((part, engram) for part in _split(members, cap))
    n = len(groups)
    return [
        ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(members), engram)
        for i, (members, engram) in enumerate(groups)
    ]


def _split(members: list[PackTensor], cap: int) -> list[list[PackTensor]]:
    """A unit larger than the cap, cut between tensors (a tensor larger than the cap stands alone)."""
    parts: list[list[PackTensor]] = [[]]
    size = 0
    for t in members:
        if parts[-1] and size + _footprint(t) > cap:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += _footprint(t)
    return parts


def _footprint(t: PackTensor) -> int:
    """Bytes in the file including the worst-case alignment pad."""
    return t.nbytes + ALIGN


def write_shard(path: Path, shard: ShardPlan, progress=None) -> int:
    """Write the header and holes, fill every hole from its source, then rename into place."""
    filling = path.with_name(path.name + ".filling")
    write_safetensors(
        filling,
        [PlannedTensor(t.name, t.source.dtype, t.source.shape, None) for t in shard.tensors],
        metadata=SHARD_METADATA,
        align=ALIGN,
    )
    placed = read_header(filling).tensors
    fd = os.open(filling, os.O_WRONLY)
    try:
        for t in shard.tensors:
            _copy(t.source, fd, placed[t.name].offset)
            if progress:
                progress(t.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(filling, path)
    return path.stat().st_size


def _copy(src: TensorEntry, dst_fd: int, dst_offset: int) -> None:
    """Copy a tensor's bytes kernel-side; fall back to reads and writes where the kernel cannot."""
    fd = os.open(src.path, os.O_RDONLY)
    try:
        done = 0
        while done < src.nbytes:
            n = min(src.nbytes - done, COPY_CHUNK)
            try:
                got = os.copy_file_range(fd, dst_fd, n, src.offset + done, dst_offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                got = os.pwrite(dst_fd, os.pread(fd, n, src.offset + done), dst_offset + done)
            if got <= 0:
                raise UserError(f"{src.path}: short read in {src.name}; the file was truncated while packing")
            done += got
    finally:
        os.close(fd)


def write_shards(out: Path, shards: list[ShardPlan]) -> list[int]:
    """All shards with one progress bar over bytes; returns each file's size."""
    with tqdm(total=sum(s.nbytes for s in shards), unit="B", unit_scale=True, desc="pack") as bar:
        return [write_shard(out / s.file, s, bar.update) for s in shards]
