"""Safetensors headers, lazy tensor reads and an aligned, crash-safe writer.

Headers are parsed and checked against the file size up front, so a truncated or corrupt shard is
reported by name before any tensor is used; tensor bytes are read only when asked for.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from quantizer.errors import UserError
from quantizer.exl3 import PACK_ALIGN

# The dtypes the safetensors format defines, with their element sizes. Anything else in a header is
# an error: a reader that guessed would dequantize garbage.
ELEMENT_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


def tensor_nbytes(dtype: str, shape) -> int:
    """Bytes of a dense tensor of this safetensors dtype and shape."""
    n = ELEMENT_BYTES[dtype]
    for d in shape:
        n *= d
    return n


# How raw bytes are viewed in torch. E8M0 scales stay uint8 (exponent bytes) until dequantization.
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.uint8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
}

SAFETENSORS_DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.int64: "I64", torch.uint64: "U64", torch.float64: "F64",
}

MAX_HEADER_BYTES = 512 << 20
PAD_PREFIX = "__align_pad__."


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: file, absolute offset, size, and what they mean."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate one file's header; every problem is a UserError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{path}: not a safetensors file ({size} bytes); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise UserError(
                    f"{path}: header claims {n} bytes but the file has {size}; the shard is truncated "
                    "or not a safetensors file, re-download it"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise UserError(f"{path}: shard is missing; download it or check the checkpoint directory")
    except IsADirectoryError:
        raise UserError(f"{path}: expected a safetensors file, found a directory")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: header is not valid JSON; the shard is corrupt, re-download it")
    if not isinstance(header, dict):
        raise UserError(f"{path}: header is not a JSON object; the shard is corrupt")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise UserError(f"{path}: __metadata__ is not an object; the shard is corrupt")
    tensors: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        tensors[name] = _entry(path, name, spec, data_start, size)
    _check_disjoint(path, tensors)
    return SafetensorsHeader(path, size, data_start, tensors, metadata)


def _check_disjoint(path: Path, tensors: dict[str, TensorEntry]) -> None:
    """Two tensors sharing bytes (overlapping or aliased offsets) would read each other's data."""
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in tensors.values() if e.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise UserError(f"{path}: tensors {first} and {second} share bytes (overlapping data_offsets); "
                            "the header is corrupt, re-download this shard")


def _entry(path: Path, name: str, spec, data_start: int, file_size: int) -> TensorEntry:
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise UserError(f"{path}: tensor {name} has a malformed header entry")
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in ELEMENT_BYTES:
        raise UserError(
            f"{path}: tensor {name} has dtype {dtype!r}, which safetensors does not define "
            f"(allowed: {', '.join(sorted(ELEMENT_BYTES))})"
        )
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise UserError(f"{path}: tensor {name} has an invalid shape {shape!r}")
    offsets = spec["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise UserError(f"{path}: tensor {name} has data_offsets {offsets!r}, not [begin, end] byte offsets; "
                        "the header is corrupt")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * ELEMENT_BYTES[dtype]:
        raise UserError(
            f"{path}: tensor {name} spans bytes [{begin}, {end}) but {dtype}{shape} needs "
            f"{numel * ELEMENT_BYTES[dtype]}; the header is corrupt"
        )
    if data_start + end > file_size:
        raise UserError(
            f"{path}: truncated: tensor {name} ends at byte {data_start + end} but the file has "
            f"{file_size} bytes; re-download this shard"
        )
    return TensorEntry(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def read_bytes(entry: TensorEntry) -> bytearray:
    buf = bytearray(entry.nbytes)
    view = memoryview(buf)
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        done = 0
        while done < entry.nbytes:
            got = os.preadv(fd, [view[done:]], entry.offset + done)
            if got <= 0:
                raise UserError(f"{entry.path}: short read in tensor {entry.name}; the shard is truncated")
            done += got
    finally:
        os.close(fd)
    return buf


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor as stored (FP8 as float8_e4m3fn, E8M0 as uint8 exponent bytes, FP4 as packed int8)."""
    dtype = TORCH_DTYPES[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(read_bytes(entry), dtype=dtype).reshape(entry.shape)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: its header entry now, its bytes from `data` when the file is written."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: torch.Tensor | None  # None writes zeros without touching the disk (sparse layouts)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def planned(name: str, tensor: torch.Tensor, dtype: str | None = None) -> PlannedTensor:
    """Wrap a torch tensor for writing; `dtype` overrides the label (e.g. F8_E8M0 for uint8 bytes)."""
    label = dtype or SAFETENSORS_DTYPES[tensor.dtype]
    return PlannedTensor(name, label, tuple(tensor.shape), tensor)


def layout(tensors: Iterable[PlannedTensor], align: int, metadata: dict[str, str] | None = None, tag: str = ""):
    """Header bytes and (offset, tensor) pairs with every tensor `align`-aligned in the file.

    Safetensors forbids holes, so gaps become small U8 tensors named `__align_pad__.<tag>.N` (the
    prefix the GB10 alignment tools already skip; the tag, the file's name, keeps pad names unique
    across the shards of a pack). Tensors whose size is a multiple of `align` go first so pads are rare.
    """
    items = sorted(tensors, key=lambda t: (t.nbytes % align != 0, t.name))
    entries: dict[str, dict] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    placed: list[tuple[int, PlannedTensor]] = []
    pos = 0
    pads = 0
    for t in items:
        at = -(-pos // align) * align
        if at > pos:
            entries[f"{PAD_PREFIX}{tag}{pads}"] = {"dtype": "U8", "shape": [at - pos], "data_offsets": [pos, at]}
            pads += 1
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        placed.append((at, t))
        pos = at + t.nbytes
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * ((-(8 + len(blob))) % max(align, 8))
    return struct.pack("<Q", len(blob)) + blob, placed, pos


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[PlannedTensor],
    metadata: dict[str, str] | None = None,
    align: int = PACK_ALIGN,
) -> int:
    """Write a shard to a temporary name and rename it, so a crash never leaves a half file.

    `align=1` packs tensors back to back as most writers do; packs use PACK_ALIGN (docs/exl3-format.md, alignment).
    Tensors with `data=None` are left as holes (zeros) in a sparse file. Returns the file size.
    """
    path = Path(path)
    head, placed, data_len = layout(tensors, align, metadata, tag=f"{path.stem}.")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for at, t in placed:
                if t.data is None:
                    continue
                data = t.data.detach().contiguous().cpu()
                raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
                if len(raw) != t.nbytes:
                    raise ValueError(f"{t.name}: {len(raw)} bytes for {t.dtype}{list(t.shape)}")
                f.seek(len(head) + at)
                f.write(raw)
            f.truncate(len(head) + data_len)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or Ctrl-C leaves no half file behind
        raise
    os.replace(tmp, path)
    return len(head) + data_len
