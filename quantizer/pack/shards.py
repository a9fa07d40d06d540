"""Pack shards: which tensor goes in which file, and writing each file by copying bytes, never decoding.

Every tensor of a pack already exists byte for byte somewhere: native tensors in the source checkpoint,
EXL3 tensors in the work directory's result files. A shard is written as its header with holes
(`write_safetensors` with data=None, 64-byte aligned) and the holes are then filled by kernel-side
copies (`copy_file_range`), so packing a 300 GB model needs no RAM beyond one header.

Layout rules: tensors are grouped in units (the top-level tensors, each trunk layer, each drafter
block, the vision tower) that are never split across shards unless one alone exceeds the cap; each
Engram layer's table and scale get shards of their own, since they are read from NVMe row by row.

An Engram source shard that the pack can use as it is (it holds one layer's table and scale and
nothing else, 64-byte aligned) becomes a pack shard by a hard link, else a reflink, on the same
filesystem, and is copied only where neither works: its hundreds of GB are then never written twice.
DeepSeek's V4.1-Flash shards hold the tables beside resident tensors, so a build from them copies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from quantizer.checkpoint.safetensors_file import (
    PAD_PREFIX,
    PlannedTensor,
    TensorEntry,
    read_header,
    write_safetensors,
)
from quantizer.errors import UserError
from quantizer.exl3 import PACK_ALIGN
from quantizer.model.tensor_classes import ENGRAM_TABLE, VISION

SHARD_METADATA = {"format": "pt"}
COPY_CHUNK = 1 << 30
FICLONE = 0x40049409  # ioctl: share all of one file's extents with another (btrfs, XFS, ...)
LINKED, REFLINKED, COPIED = "hard link", "reflink", "copy"
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
    reuse: Path | None = None  # a source file that is this shard byte for byte

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


def reusable_sources(tensors: list[PackTensor], align: int = PACK_ALIGN) -> dict[Path, list[PackTensor]]:
    """Source files a pack's Engram shard can be as they are: the file holds one layer's Engram table
    and scale and nothing else (the pack keeps tables in shards of their own), passed through
    unchanged, with its data aligned as the pack's (`align`)."""
    by_file: dict[Path, list[PackTensor]] = {}
    for t in tensors:
        by_file.setdefault(t.source.path, []).append(t)
    out = {}
    for path, members in by_file.items():
        if any(t.cls != ENGRAM_TABLE or t.K != "native" for t in members) or len({unit_of(t) for t in members}) != 1:
            continue
        header = read_header(path).tensors
        real = {n: e for n, e in header.items() if not n.startswith(PAD_PREFIX)}
        if set(real) == {t.name for t in members} and all(e.offset % align == 0 for e in real.values()):
            out[path] = members
    return out


def assign_shards(tensors: list[PackTensor], cap: int, reused: dict[Path, list[PackTensor]] | None = None
                  ) -> list[ShardPlan]:
    """Units in order, greedily filled up to `cap` bytes; Engram units always start their own shard.
    `reused` source files (reusable_sources) are shards of their own, placed with the Engram shards."""
    reused = reused or {}
    taken = {id(t) for members in reused.values() for t in members}
    units: dict[tuple, list[PackTensor]] = {}
    for t in sorted((t for t in tensors if id(t) not in taken), key=lambda t: (unit_of(t), t.name)):
        units.setdefault(unit_of(t), []).append(t)
    whole = {min(unit_of(t) for t in members if t.cls == ENGRAM_TABLE): path for path, members in reused.items()}
    for key in whole:
        units.setdefault(key, [])
    groups: list[tuple[list[PackTensor], bool, Path | None]] = []
    for key in sorted(units):
        if key in whole:
            groups.append((reused[whole[key]], True, whole[key]))
            if not units[key]:
                continue
        _place(groups, units[key], key[0] == 4, cap)
    n = len(groups)
    return [
        ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(members), engram, reuse)
        for i, (members, engram, reuse) in enumerate(groups)
    ]


def _place(groups: list, members: list[PackTensor], engram: bool, cap: int) -> None:
    """Add one unit: to the open shard when it fits, else in shards of its own."""
    size = sum(_footprint(t) for t in members)
    open_group = groups[-1] if groups and not groups[-1][1] and not engram else None
    if open_group is not None and sum(_footprint(t) for t in open_group[0]) + size <= cap:
        open_group[0].extend(members)
    elif size <= cap:
        groups.append((list(members), engram, None))
    else:
        groups.extend((part, engram, None) for part in _split(members, cap))


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
    return t.nbytes + PACK_ALIGN


def write_shard(path: Path, shard: ShardPlan, progress=None, align: int = PACK_ALIGN) -> str:
    """Write the header and holes, fill every hole from its source, then rename into place; a reused
    source file is linked instead. Returns how the shard was made (LINKED, REFLINKED or COPIED)."""
    filling = path.with_name(path.name + ".filling")
    if shard.reuse is not None:
        how = link_or_copy(shard.reuse, filling)
        os.replace(filling, path)
        if progress:
            progress(shard.nbytes)
        return how
    write_safetensors(
        filling,
        [PlannedTensor(t.name, t.source.dtype, t.source.shape, None) for t in shard.tensors],
        metadata=SHARD_METADATA,
        align=align,
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
    return COPIED


def link_or_copy(src: Path, dst: Path) -> str:
    """`dst` as the same bytes as `src`: a hard link, else a reflink (same filesystem), else a copy."""
    src = Path(os.path.realpath(src))  # a Hugging Face snapshot links to its blob
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return LINKED
    except OSError:
        pass  # another filesystem, or links refused (protected_hardlinks, a filesystem without them)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return REFLINKED
        except OSError:
            shutil.copyfileobj(fin, fout, COPY_CHUNK)
            fout.flush()
            os.fsync(fout.fileno())
    return COPIED


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


def write_shards(out: Path, shards: list[ShardPlan], align: int = PACK_ALIGN) -> list[str]:
    """All shards with one progress bar over bytes, tensors `align`-aligned (1: back to back, no pad
    tensors); returns how each was made."""
    with tqdm(total=sum(s.nbytes for s in shards), unit="B", unit_scale=True, desc="pack") as bar:
        return [write_shard(out / s.file, s, bar.update, align) for s in shards]
