"""How calibration results sit on disk, the reader the quantize stage uses, and what a quantize job pins of them.

WORK/calibration/
  job.json              source fingerprint, token rows hash, settings, calibration fingerprint
  source.json           the source shards' content hashes (checkpoint/fingerprint.py), kept for reruns
  layer_NNN.safetensors one trunk layer's Hessians; its statistics as JSON in the metadata
  head.safetensors      the head's Hessian (final hidden)
  streams_LLL_CCCC.safetensors  row chunk CCCC's hc streams + forward state before layer LLL (the
                        resume point; deleted once the summary is written)
  summary.json          the CalibrationSummary for the allocator; its presence means "complete"

A Hessian is stored as its mean H = E[x x^T] in two tensors: `<group>.diag` (F32, the diagonal d) and
`<group>.corr` (the packed upper triangle, row-major, of the correlation D^-1/2 H D^-1/2), F32 or,
for the routed experts' groups (down projections, and their own inputs when calibrated with
--expert-hessians other than shared) by default, F16. Correlations lie in [-1, 1], so F16 keeps
~3.3 significant digits relative to sqrt(d_i d_j) for every entry, whatever the channel scales; the
triangle halves the bytes again. Token counts are in the metadata.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from quantizer.calibrate.groups import HEAD_KEY, SLICE, stored_group, wo_a_slices
from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.safetensors_file import (
    SafetensorsHeader,
    planned,
    read_header,
    read_tensor,
    write_safetensors,
)
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.model.targets import target_map
from quantizer.workdir import FINGERPRINT_CACHE, JOB_NAME

CALIBRATION_DIR = "calibration"
JOB_FILE = JOB_NAME
SUMMARY_FILE = "summary.json"
STREAMS_PREFIX = "streams_"
HEAD_FILE = "head.safetensors"
META_KEY = "calibration"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def read_summary(path: str | Path) -> CalibrationSummary:
    """The calibration summary at `path`: a summary file, a calibrate work directory
    (WORK/calibration/summary.json) or a calibration directory (its summary.json)."""
    path = Path(path)
    if path.is_dir():
        nested = path / CALIBRATION_DIR / SUMMARY_FILE
        path = nested if nested.exists() else path / SUMMARY_FILE
    return CalibrationSummary.load(path)


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


def _triu_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu()


def pack_hessian(key: str, h: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{key.diag, key.corr} of a mean Hessian, on the CPU (see the module docstring)."""
    h = h.float()
    d = h.diagonal().clamp(min=0)
    inv = torch.where(d > 0, d.rsqrt(), torch.zeros_like(d))
    corr = (h * inv.unsqueeze(0) * inv.unsqueeze(1))[_triu_mask(h.shape[0], h.device)]
    return {f"{key}.diag": d.cpu(), f"{key}.corr": corr.clamp(-1, 1).to(dtype).cpu()}


def unpack_hessian(diag: torch.Tensor, corr: torch.Tensor) -> torch.Tensor:
    """The mean Hessian [n, n] float32 from its stored parts. The quantize stage's preparing thread unpacks
    one per routed expert while the GPU encodes, so the triangle goes in row by row and is mirrored in place:
    a third of the time of a boolean-mask scatter on the CPU, with the same bits."""
    n = diag.numel()
    if corr.numel() != n * (n + 1) // 2:
        raise ValueError(f"a packed triangle of {n} channels has {n * (n + 1) // 2} entries, not {corr.numel()}")
    full = torch.zeros(n, n, dtype=torch.float32)
    start = 0
    for i in range(n):
        full[i, i:] = corr[start:start + n - i]
        start += n - i
    full.add_(full.T.tril(-1))
    s = diag.float().sqrt()
    return full.mul_(s.unsqueeze(1) * s.unsqueeze(0))  # s_i s_j is exactly symmetric, so H is


def write_stats_file(path: Path, hessians: dict[str, torch.Tensor], meta: dict) -> None:
    """One layer's (or the head's) packed Hessians and its statistics, atomically."""
    write_safetensors(path, [planned(name, t) for name, t in hessians.items()],
                      metadata={META_KEY: json.dumps(meta)})


def read_meta(path: Path) -> dict:
    return json.loads(read_header(path).metadata[META_KEY])


@dataclass(frozen=True)
class HessianRecord:
    """What a quantize job pins of the Hessians it reads, stored under "calibration" in its job.json and the
    pack's manifest: a rerun with other Hessians is refused, the pack's quantization_config names the token
    rows x cols, and with `expert_inputs` (routed gate/up projections have one H per expert) the quantize
    stage's memory estimate counts one H per expert."""

    fingerprint: str  # of the calibration (source, tokens, settings)
    rows: int
    cols: int
    expert_inputs: bool = False

    def to_dict(self) -> dict:
        """The stored form: `expert_inputs` only when true, so records from before it read the same."""
        record = {"fingerprint": self.fingerprint, "rows": self.rows, "cols": self.cols}
        return {**record, "expert_inputs": True} if self.expert_inputs else record

    @classmethod
    def from_dict(cls, data, where: str) -> HessianRecord:
        """The record read back from a job file or manifest at `where`; one UserError line if malformed."""
        types = {"fingerprint": str, "rows": int, "cols": int, "expert_inputs": bool}
        if (not isinstance(data, dict) or not {"fingerprint", "rows", "cols"} <= data.keys() <= types.keys()
                or any(type(v) is not types[k] for k, v in data.items())):
            raise UserError(f"{where}: not a Hessian record {{fingerprint, rows, cols[, expert_inputs]}}: {data!r}")
        return cls(**data)


class HessianStore:
    """The Hessians of a finished calibration, by EXL3 key (what the quantize stage asks for).

    `hessian(key)` -> (H summed over `count` tokens [in, in] float32, count) or None: the quantize
    stage's HessianProvider contract (H / count is the mean; count is the tokens the statistics
    represent, for a routed down projection its routed tokens plus the prior's token weight). Keys
    are target keys or wo_a slice keys (`<wo_a key>.slice.<g>`); the fused wo_a key gets the mean of its
    slices. Linears that share an input get the same object back (the CUDA encoder then runs one
    shared LDLQ), as long as they are asked for one after the other.
    """

    CACHED = 4  # groups kept in memory: a layer's shared groups stay while its experts are encoded

    def __init__(self, work: str | Path, ck: Checkpoint):
        """Refuses an incomplete calibration, and one made from another checkpoint than `ck`."""
        self.dir = Path(work) / CALIBRATION_DIR
        summary = self.dir / SUMMARY_FILE
        if not summary.exists():
            raise UserError(f"{self.dir}: calibration is not complete (no {SUMMARY_FILE}); "
                            "rerun `quantizer calibrate` with the same arguments to finish it")
        self.cfg = ck.config
        self.job = json.loads((self.dir / JOB_FILE).read_text())
        if self.job["source"]["fingerprint"] != source_fingerprint(ck, self.dir / FINGERPRINT_CACHE):
            raise UserError(f"{self.dir}: calibrated from {self.job['source']['path']}, another checkpoint than "
                            f"{ck.root} (fingerprints differ); calibrate this one in another work directory")
        # routed gate/up projections read their expert's own input group (settings.expert_inputs)
        self.expert_inputs = self.job["settings"].get("expert_hessians", "shared") != "shared"
        self._headers: dict[str, tuple[SafetensorsHeader, dict]] = {}
        self._cache: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()

    @property
    def record(self) -> HessianRecord:
        """What a quantize job reading these Hessians pins."""
        tokens = self.job["tokens"]
        return HessianRecord(self.job["fingerprint"], tokens["rows"], tokens["cols"], self.expert_inputs)

    def summary(self) -> CalibrationSummary:
        return CalibrationSummary.load(self.dir / SUMMARY_FILE)

    def hessian(self, key: str) -> tuple[torch.Tensor, int] | None:
        group = self._group(key)
        if group is None:
            return None
        if group not in self._cache:
            mean, tokens = self.mean(group)
            if tokens <= 0:
                return None  # no token reached it (a dead expert calibrated with --prior-tokens 0)
            count = max(1, round(tokens))
            self._cache[group] = (mean.mul_(count), count)
            if len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        self._cache.move_to_end(group)
        return self._cache[group]

    def mean(self, group: str) -> tuple[torch.Tensor, float]:
        """(mean H [in, in] float32, tokens) of a stored group, or the mean over a wo_a target's slices;
        a group no token reached has count 0 (and H 0)."""
        base = self._target_of(group)
        if base is not None and base.proj == "wo_a" and group == base.key:
            parts = [self.mean(s) for s in wo_a_slices(self.cfg, group)]
            return torch.stack([p[0] for p in parts]).mean(0), parts[0][1]
        path = self.dir / (HEAD_FILE if group == HEAD_KEY else layer_file(int(group.split(".")[1])))
        header, meta = self._header(path)
        if f"{group}.diag" not in header.tensors:
            raise UserError(f"{path}: has no Hessian {group!r}; delete {self.dir} and calibrate again")
        diag, corr = (read_tensor(header.tensors[f"{group}.{part}"]) for part in ("diag", "corr"))
        try:
            mean = unpack_hessian(diag, corr)
        except ValueError as e:
            raise UserError(f"{path}: Hessian {group!r}: {e}; delete {self.dir} and calibrate again") from None
        return mean, float(meta["counts"][group])

    def _target_of(self, key: str):
        return target_map(self.cfg).get(key.split(SLICE)[0])

    def _group(self, key: str) -> str | None:
        target = self._target_of(key)
        if target is None:
            raise KeyError(f"{key!r} is not an EXL3 target of this model")
        return stored_group(key, target, self.expert_inputs)  # None: the drafter; slices their own

    def _header(self, path: Path) -> tuple[SafetensorsHeader, dict]:
        if path.name not in self._headers:
            if not path.exists():
                raise UserError(f"{path}: missing; delete {self.dir} and calibrate again")
            header = read_header(path)
            self._headers[path.name] = (header, json.loads(header.metadata[META_KEY]))
        return self._headers[path.name]
