"""`WORK/quantized/`: a cache of encodings, one safetensors file per finished work unit, written atomically.

A unit is one EXL3 linear (CPU) or a batch of same-shape linears encoded together (GPU). Its file is
named by the unit and the digest of everything that determines its bytes (linears.py, unit_digest),
so plans that share a (linear, K) share its file, and a file made under other settings is never
mistaken for this one. It holds exactly the tensors exllamav3 stores for each of its linears; its
metadata names the linears, their K and their measured proxy errors. A file that exists is finished
(it appears by rename); one that cannot be read back is deleted and its unit redone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from quantizer.checkpoint.safetensors_file import PAD_PREFIX, TensorEntry, planned, read_header, write_safetensors
from quantizer.errors import UserError
from quantizer.exl3 import PACK_ALIGN

RESULTS_DIR = "quantized"
SUFFIX = ".safetensors"
DIGEST_CHARS = 16  # of the unit digest in its file name


@dataclass(frozen=True)
class Unit:
    """Linears encoded in one call and saved in one file; all share K (and, batched, a shape)."""

    name: str
    keys: tuple[str, ...]
    K: float | int
    weights: int  # in*out summed over the keys: the progress measure
    digest: str = ""  # of what determines the encoding (linears.unit_digest); names the unit's file


class ResultStore:
    def __init__(self, work: Path):
        self.dir = Path(work) / RESULTS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)

    def drop_unfinished(self) -> None:
        """Delete the writes a kill interrupted (their units are not done); only while nobody writes."""
        for stale in self.dir.glob("*.tmp"):
            stale.unlink()

    def path(self, unit: Unit) -> Path:
        return unit_path(self.dir, unit)

    def done(self, unit: Unit) -> bool:
        path = self.path(unit)
        if not path.exists():
            return False
        try:
            names = read_header(path).tensors
        except UserError:
            names = {}
        if all(f"{k}.trellis" in names or f"{k}.weight" in names for k in unit.keys):
            return True
        path.unlink()
        return False

    def save(self, unit: Unit, tensors: dict[str, torch.Tensor], proxy_err: dict[str, float | None]) -> None:
        metadata = {"keys": json.dumps(list(unit.keys)), "K": f"{unit.K:g}", "proxy_err": json.dumps(proxy_err)}
        write_safetensors(self.path(unit), [planned(n, t) for n, t in tensors.items()], metadata=metadata,
                          align=PACK_ALIGN)

    def entries(self, units: list[Unit]) -> dict[str, TensorEntry]:
        """Every stored tensor of these units' files (those that exist), by name."""
        out: dict[str, TensorEntry] = {}
        for path in self._existing(units):
            out.update({n: e for n, e in read_header(path).tensors.items() if not n.startswith(PAD_PREFIX)})
        return out

    def proxy_errors(self, units: list[Unit]) -> dict[str, float | None]:
        """Stored key -> measured proxy error of these units' linears (None for fp16 ones)."""
        out: dict[str, float | None] = {}
        for path in self._existing(units):
            out.update(json.loads(read_header(path).metadata.get("proxy_err", "{}")))
        return out

    def _existing(self, units: list[Unit]) -> list[Path]:
        return [p for p in map(self.path, units) if p.exists()]


def measured_encodings(work: Path, units: list[Unit] | None = None) -> list[tuple[float, dict[str, float | None]]]:
    """(K, stored key -> proxy error) of the finished encodings in the cache `work` (nothing is
    created): of these units, or of every file whatever plan it was made for."""
    folder = Path(work) / RESULTS_DIR
    if units is None:
        paths = sorted(folder.glob("*" + SUFFIX))
    else:
        paths = [p for p in (unit_path(folder, u) for u in units) if p.exists()]
    out = []
    for path in paths:
        meta = read_header(path).metadata
        out.append((float(meta["K"]), json.loads(meta.get("proxy_err", "{}"))))
    return out


def unit_path(folder: Path, unit: Unit) -> Path:
    """`<unit name>.<digest>.safetensors`: the unit's file in a cache folder."""
    if not unit.digest:
        raise ValueError(f"unit {unit.name} has no digest; make units with linears.plan_units")
    return folder / f"{unit.name}.{unit.digest[:DIGEST_CHARS]}{SUFFIX}"
