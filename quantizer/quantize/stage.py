"""The quantize stage: every EXL3 linear of a plan encoded into the work directory, resumably.

Reads the checkpoint layer by layer (one unit's dequantized weights in memory at a time), encodes on
the CPU with our codec or on CUDA with exllamav3, and saves each unit atomically in WORK/quantized/.
Kill it at any moment and rerun: finished units are kept, the rest are encoded with the same
per-linear seeds, so the results (and the pack) are byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.plan.plan import Plan
from quantizer.plan.sizes import exl3_bytes
from quantizer.quantize.encode import encode_unit
from quantizer.quantize.job import JobSpec, job_differences
from quantizer.quantize.linears import StoredLinear, stored_linears, work_units
from quantizer.quantize.results import ResultStore
from quantizer.quantize.settings import QuantizeSettings
from quantizer.report import size_text
from quantizer.workdir import FINGERPRINT_CACHE, job_lock, open_job, require_free_space

# hessian(stored key) -> (H [in, in] float32 summed over `count` rows, count), or None (uncalibrated)
HessianProvider = Callable[[str], "tuple[torch.Tensor, int] | None"]

WORKING_COPIES = 4  # fp32 copies of a unit's weights an encoder holds (input, rotated, decoded, error)
# The process itself: torch, the codec's Viterbi chunks (256 MiB) and tables; tiny V4.1 at 2.5 bpw
# peaked at 0.54 GB resident.
BASE_RAM = 640 << 20


@dataclass(frozen=True)
class QuantizeResult:
    work: Path
    units: int
    resumed_units: int  # finished before this run
    seconds: float
    proxy_err: dict[str, float | None]  # stored key -> proxy error (None for fp16 linears)


def quantize(
    ck: Checkpoint,
    plan: Plan,
    work: str | Path,
    settings: QuantizeSettings,
    hessian: HessianProvider | None = None,
    on_start: Callable[[], None] | None = None,
) -> QuantizeResult:
    """Encode (or finish encoding) `plan` into `work`; `on_start` runs once the job is locked and
    accepted, before any encoding (build saves the plan there, so a refused rerun changes nothing)."""
    work = Path(work)
    if settings.device == "cuda":
        _check_cuda()
    with job_lock(work):
        spec = JobSpec(
            source={"path": str(ck.root), "fingerprint": source_fingerprint(ck, work / FINGERPRINT_CACHE)},
            plan={"hash": plan.content_hash(), "K": plan.k, "codebook": plan.codebook, "loader": plan.loader,
                  "aliases": plan.aliases},
            settings=settings.record(),
        )
        open_job(work, asdict(spec), job_differences, "quantize job")
        if on_start:
            on_start()
        return _run(ck, plan, work, settings, hessian)


def _run(ck: Checkpoint, plan: Plan, work: Path, settings: QuantizeSettings, hessian) -> QuantizeResult:
    linears = stored_linears(ck.config, plan)
    by_key = {s.key: s for s in linears}
    units = work_units(linears, settings.device)
    store = ResultStore(work)
    todo = [u for u in units if not store.done(u)]
    ram, disk = _needs(todo, by_key, plan.codebook)
    print(_needs_line(work, linears, units, todo, settings, ram, disk), file=sys.stderr)
    require_free_space(work, disk, "the quantized results")
    start = time.monotonic()
    reader = WeightReader(ck, settings.device)
    with tqdm(total=sum(u.weights for u in todo), unit="w", unit_scale=True, desc="quantize") as bar:
        for unit in todo:
            bar.set_postfix_str(unit.name, refresh=False)
            members = [by_key[k] for k in unit.keys]
            weights = [reader.weight(s) for s in members]
            hessians = [hessian(s.key) if hessian else None for s in members]
            encoded = encode_unit(unit.name, members, weights, hessians, plan.codebook, settings)
            store.save(unit, encoded.tensors, encoded.proxy_err)
            bar.update(unit.weights)
    seconds = time.monotonic() - start
    return QuantizeResult(work, len(units), len(units) - len(todo), seconds, store.proxy_errors())


def _check_cuda() -> None:
    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu or run on a GPU machine")
    if importlib.util.find_spec("exllamav3") is None:
        raise UserError("--device cuda needs exllamav3 1.6.5: pip install 'quantizer[gpu]'")


class WeightReader:
    """Dequantized source weights, [out, in] float32 on the encoding device; a fused tensor (wo_a) is
    dequantized once for all its slices and dropped when the next source tensor is read."""

    def __init__(self, ck: Checkpoint, device: str):
        self.ck = ck
        self.device = device
        self._last: tuple[str, torch.Tensor] | None = None

    def weight(self, s: StoredLinear) -> torch.Tensor:
        name = s.target.key + ".weight"
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before reading the next
            self._last = (name, self.ck.weight(name, device=self.device))
        w = self._last[1]
        return w[s.rows[0] : s.rows[1]] if s.rows else w


def _needs(todo, by_key, codebook) -> tuple[int, int]:
    """RAM: the process plus the largest unit (its fp32 weights and Hessians, times the encoder's working
    copies); disk: the results still to write."""
    members = [[by_key[k] for k in u.keys] for u in todo]
    ram = BASE_RAM + max((WORKING_COPIES * 4 * sum(s.numel + s.in_features**2 for s in m) for m in members), default=0)
    disk = sum(exl3_bytes(s.in_features, s.out_features, s.K, codebook) for m in members for s in m)
    return ram, disk


def _needs_line(work, linears, units, todo, settings, ram: int, disk: int) -> str:
    weights = sum(u.weights for u in todo)
    how = "exllamav3 on cuda" if settings.device == "cuda" else f"our codec on cpu ({settings.encoder} encoder)"
    return (
        f"quantize: {len(linears):,} linears in {len(units):,} units, {len(units) - len(todo):,} already done; "
        f"{weights:,} weights to encode with {how}; needs ~{size_text(ram)} RAM and "
        f"~{size_text(disk)} disk in {work / 'quantized'}"
    )

