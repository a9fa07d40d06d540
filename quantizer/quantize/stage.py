"""The quantize stage: every EXL3 linear of a plan encoded into the work directory's cache, resumably.

Reads the checkpoint layer by layer, encodes on the CPU with our codec or on CUDA with exllamav3, and
saves each unit atomically in WORK/quantized/. The three steps overlap (pipeline.py): the next unit's
weights are dequantized and its Hessians loaded while this one encodes, and the last one is written
behind it, so in memory are at most the unit encoding, one prepared unit and one being written.
Kill it at any moment and rerun: finished units are kept, the rest are encoded with the same
per-linear seeds, so the results (and the pack) are byte-identical to an uninterrupted run. The
directory is a cache of encodings (results.py): a unit's file is named by the digest of what determines
it, so another plan in the same directory encodes only the (linear, K) pairs no earlier plan had, and
reuses the rest byte for byte. job.json pins the source and the settings, not the plan.
Under torchrun the units still to do are spread over the ranks (largest first onto the least loaded
rank); each rank writes its own units into the shared directory, so a rerun with any number of ranks
continues from whatever any of them finished. With --encoder ours on CUDA our tile kernel is compiled (on
first use on a machine, minutes, said in two lines) or loaded before the first unit.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from quantizer.calibrate.groups import stored_group
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec.exllamav3_adapter import release_encoder_buffers
from quantizer.codec.exllamav3_batch import ORIGINAL_ON_HOST_ABOVE
from quantizer.codec.kernel import load as load_kernel
from quantizer.contract.pack_spec import REPLACED_LEAVES, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.stored_linear import StoredLinear
from quantizer.distributed import current
from quantizer.errors import UserError
from quantizer.exl3 import exl3_bytes
from quantizer.model.targets import targets
from quantizer.quantize.encode import EncodedUnit, encode_unit
from quantizer.quantize.encode_hours import RateTable, estimate
from quantizer.quantize.job import JobSpec, job_differences
from quantizer.quantize.linears import plan_units
from quantizer.quantize.pipeline import PREFETCH_UNITS, run_pipeline
from quantizer.quantize.results import ResultStore, Unit
from quantizer.quantize.settings import ENCODERS, QuantizeSettings
from quantizer.report import size_text
from quantizer.workdir import FINGERPRINT_CACHE, open_job, require_free_space

# hessian(stored key) -> (H [in, in] float32 summed over `count` rows, count), or None (uncalibrated)
HessianProvider = Callable[[str], "tuple[torch.Tensor, int] | None"]

WORKING_COPIES = 4  # fp32 copies of a unit's weights an encoder holds (input, rotated, decoded, error)
# The process itself: torch, the codec's Viterbi chunks (256 MiB) and tables; tiny V4.1 at 2.5 bpw
# peaked at 0.54 GB resident.
BASE_RAM = 640 << 20
# On CUDA: torch, the CUDA context and exllamav3's extension, resident before the first unit
# (bench/rehearsal.py: 1.94 GiB at the quantize stage's start).
BASE_RAM_CUDA = 2 << 30
# Our tile kernel's history scratch for one launch at its largest: one block per SM (132 on an H100 or
# H200), 16 MiB a block at K 1-3 (docs/encoder.md, "Our tile kernel").
KERNEL_SCRATCH = 132 * (16 << 20)


@dataclass(frozen=True)
class QuantizeResult:
    work: Path
    units: int
    resumed_units: int  # finished before this run (by this plan or another plan sharing the directory)
    seconds: float
    proxy_err: dict[str, float | None]  # stored key -> proxy error (None for fp16 linears)
    # unit name -> seconds from the encoder finishing the unit before (or the stage's start) to finishing this
    # one, its wait for inputs included: where this run's encoder time went (this rank's units; none resumed)
    unit_seconds: dict[str, float]


def quantize(
    ck: Checkpoint,
    plan: Plan,
    work: str | Path,
    settings: QuantizeSettings,
    hessian: HessianProvider | None = None,
    depth: int = PREFETCH_UNITS,
    on_start: Callable[[], None] | None = None,
    source_check: Callable[[list[str]], None] | None = None,
) -> QuantizeResult:
    """Encode (or finish encoding) every linear of `plan` not yet finished in `work`. `depth` units are
    read, dequantized and given their Hessians ahead of the encoder (0: one step after another; the
    results are the same). `on_start` runs once the job is locked and accepted, before any encoding
    (build saves the plan there, so a refused rerun changes nothing). `source_check(names)` runs before
    each unit is saved with the source tensors it was read from, and raises if they may have changed
    since (build: orchestrate/source_guard.py), so no unit of changed bytes enters the cache. Under torchrun
    rank 0 holds the lock and checks the job; every rank encodes its share."""
    work = Path(work)
    if settings.device == "cuda":
        check_cuda()

    def accept() -> None:
        spec = JobSpec(
            source={"path": str(ck.root), "fingerprint": source_fingerprint(ck, work / FINGERPRINT_CACHE)},
            settings=settings.record(),
        )
        open_job(work, asdict(spec), job_differences, "quantize job")
        if on_start:
            on_start()

    ranks = current()
    with ranks.lock(work):
        ranks.on_main(accept)
        return _run(ck, plan, work, settings, hessian, depth, source_check)


def _run(ck: Checkpoint, plan: Plan, work: Path, settings: QuantizeSettings, hessian, depth: int,
         source_check: Callable[[list[str]], None] | None) -> QuantizeResult:
    spec = pack_spec(ck.config, plan)
    linears = spec.encoded
    by_key = {s.key: s for s in linears}
    units = plan_units(spec, plan.codebook, settings.record())
    store = ResultStore(work)
    ranks = current()
    todo = ranks.on_main(lambda: _todo(store, units))
    expert_inputs = settings.hessians is not None and settings.hessians.expert_inputs
    mine = [todo[i] for i in ranks.spread([u.weights for u in todo])]
    ram = quantize_ram(mine, by_key, depth, settings.device, expert_inputs, settings.encoder)
    gpu = quantize_gpu_memory(mine, by_key, depth, expert_inputs) if settings.encoder == "ours" else None
    disk = quantize_disk(todo, by_key, plan.codebook)
    if ranks.main:
        print(_needs_line(work, linears, units, todo, settings, ram, gpu, disk), file=sys.stderr)
    ranks.on_main(lambda: require_free_space(work, disk, "the quantized results"))
    if settings.device == "cuda" and settings.encoder == "ours" and mine:
        load_kernel(lambda line: print(f"quantize: {line}", file=sys.stderr) if ranks.main else None)
    start = last = time.monotonic()
    unit_seconds: dict[str, float] = {}
    prepare = UnitInputs(ck, by_key, hessian, settings.device)

    def encode(unit: Unit, inputs: PreparedUnit) -> EncodedUnit:
        nonlocal last
        inputs.ready()
        encoded = encode_unit(unit.name, inputs.members, inputs.weights, inputs.hessians, plan.codebook, settings)
        now = time.monotonic()
        unit_seconds[unit.name], last = now - last, now
        return encoded

    def save(unit: Unit, encoded: EncodedUnit) -> None:
        if source_check:
            source_check([by_key[k].target.key + leaf for k in unit.keys for leaf in REPLACED_LEAVES])
        store.save(unit, encoded.tensors, encoded.proxy_err)

    desc = f"quantize rank {ranks.rank}" if ranks.joined else "quantize"
    try:
        with tqdm(total=sum(u.weights for u in mine), unit="w", unit_scale=True, desc=desc) as bar:
            for unit in run_pipeline(mine, prepare, encode, save, depth):
                bar.set_postfix_str(unit.name, refresh=False)
                bar.update(unit.weights)
    finally:
        if settings.device == "cuda":
            release_encoder_buffers()  # the tune and pack stages after this one get the encoder's scratch back
    ranks.barrier()  # every rank's units are in before the results are read
    seconds = time.monotonic() - start
    return QuantizeResult(work, len(units), len(units) - len(todo), seconds, store.proxy_errors(units), unit_seconds)


def measured_proxies(cfg: ModelConfig, encodings: list[tuple[float, dict[str, float | None]]]
                     ) -> dict[str, dict[float, float]]:
    """Target key -> K -> measured proxy error (a wo_a's slices averaged) of the budgeted targets, from
    (K, stored key -> error) per encoded unit (results.measured_encodings): what the allocator can use
    in place of its model."""
    per: dict[tuple[str, float], list[float]] = defaultdict(list)
    for k, errors in encodings:
        for key, err in errors.items():
            if err is not None:
                per[key.split(".slice.")[0], k].append(err)
    budgeted = {t.key for t in targets(cfg) if t.budgeted}
    out: dict[str, dict[float, float]] = defaultdict(dict)
    for (key, k), errs in per.items():
        if key in budgeted:
            out[key][k] = sum(errs) / len(errs)
    return dict(out)


def _todo(store: ResultStore, units: list[Unit]) -> list[Unit]:
    """The units without a finished result (interrupted writes dropped first)."""
    store.drop_unfinished()
    return [u for u in units if not store.done(u)]


def check_cuda() -> None:
    """The quantize stage on CUDA needs a visible GPU and exllamav3 (build checks it before its first stage)."""
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


@dataclass
class PreparedUnit:
    """A unit's inputs on the encoding device; on CUDA they were made on the preparing thread's own stream."""

    members: list[StoredLinear]
    weights: list[torch.Tensor]
    hessians: list
    made: "torch.cuda.Event | None" = None

    def ready(self) -> None:
        """Make the encoding stream wait for the copies and dequantization that made these inputs."""
        if self.made is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.made)
        for w in self.weights:
            w.record_stream(stream)  # its memory is not reused by the preparing stream while the encoder reads it


class UnitInputs:
    """Prepares one unit for the encoder: its dequantized weights and its Hessians (called from the
    pipeline's preparing thread, which alone uses the reader and the Hessian provider)."""

    def __init__(self, ck: Checkpoint, by_key: dict[str, StoredLinear], hessian, device: str):
        self.by_key = by_key
        self.hessian = hessian
        # The caller's CUDA device by index: a new thread starts on device 0 whatever the caller set.
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
        self.reader = WeightReader(ck, str(self.device) if self.device else device)
        self.stream = torch.cuda.Stream(self.device) if self.device else None

    def __call__(self, unit: Unit) -> PreparedUnit:
        members = [self.by_key[k] for k in unit.keys]
        hessians = [self.hessian(s.key) if self.hessian else None for s in members]
        if self.stream is None:
            return PreparedUnit(members, [self.reader.weight(s) for s in members], hessians)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            weights = [self.reader.weight(s) for s in members]
            made = torch.cuda.Event()
            made.record(self.stream)
        return PreparedUnit(members, weights, hessians, made)


def quantize_disk(todo, by_key, codebook) -> int:
    """Disk of encoding `todo`: the results still to write."""
    return sum(exl3_bytes(by_key[k].in_features, by_key[k].out_features, by_key[k].K, codebook)
               for u in todo for k in u.keys)


def quantize_ram(units, by_key, depth: int, device: str, expert_inputs: bool = False, encoder: str | None = None) -> int:
    """Host RAM of encoding `units` in this order, `depth` of them prepared ahead of the one encoding
    (quantize/pipeline.py). On a CPU: the process plus the largest unit (its fp32 weights and Hessians)
    times the encoder's working copies and the units prepared ahead. On CUDA the weights are read and
    encoded on the GPU; the process with its CUDA context plus what the conversion keeps on the host:
    with exllamav3's own conversion the largest unit's (_host_bytes_cuda) for the unit encoding and each
    one prepared ahead; with ours, which keeps little of the unit encoding, the most that it and the
    `depth` units after it hold at once (_held_by_ours). expert_inputs: routed gate/up projections have one
    H per expert (calibrate/groups.py).
    `encoder`: the CUDA encoder (default: the device's default)."""
    members = [[by_key[k] for k in u.keys] for u in units]
    if device != "cuda":
        largest = max((4 * sum(s.numel + s.in_features**2 for s in m) for m in members), default=0)
        return BASE_RAM + (WORKING_COPIES + depth) * largest
    if (encoder or ENCODERS["cuda"][0]) != "ours":
        return BASE_RAM_CUDA + (depth + 1) * max((_host_bytes_cuda(m, expert_inputs) for m in members), default=0)
    return BASE_RAM_CUDA + _held_by_ours(members, depth, expert_inputs)


def _host_bytes_cuda(members: list[StoredLinear], expert_inputs: bool) -> int:
    """Host bytes exllamav3's `quantize_exl3_batch` keeps for one unit: it moves each Hessian and factor to
    the CPU (docs/exl3-format.md), 4 bytes per weight and its float32 Hessians (a shared one once): 1.04x
    and 1.09x the peaks bench/rehearsal.py measured on one layer of 32 and of 64 experts."""
    return 4 * sum(s.numel for s in members) + _hessian_bytes(members, expert_inputs)


def quantize_gpu_memory(units, by_key, depth: int, expert_inputs: bool = False) -> int:
    """Peak GPU memory of encoding `units` in this order on CUDA with our conversion
    (codec/exllamav3_batch.py): the unit encoding (_gpu_bytes_ours) and the fp32 weights of the `depth`
    units after it, which the preparing thread has already read onto the GPU, plus our tile kernel's
    scratch. 20.6 GiB for the 22.2 bench/rehearsal.py measured on one layer of 32 experts, 50.7 for the 55.0
    bench/quantize_gpu_memory.py measured on one batch of 91 (docs/measurements.md)."""
    members = [[by_key[k] for k in u.keys] for u in units]
    read = [4 * sum(s.numel for s in m) for m in members]
    return KERNEL_SCRATCH + max((_gpu_bytes_ours(m, expert_inputs) + sum(read[i + 1:i + 1 + depth])
                                 for i, m in enumerate(members)), default=0)


def _gpu_bytes_ours(members: list[StoredLinear], expert_inputs: bool) -> int:
    """What our conversion holds on the GPU for one unit at once: each weight as read ([out, in] fp32),
    transposed for exllamav3, stacked for LDLQ and as LDLQ's output (4 bytes each), its trellis states
    (int16), and its original for the refit where it stays on the GPU (up to ORIGINAL_ON_HOST_ABOVE weights);
    each Hessian three times (copied to the GPU, finalized, its block-LDL factor)."""
    weights = sum(s.numel for s in members)
    originals = sum(s.numel for s in members if s.numel <= ORIGINAL_ON_HOST_ABOVE)
    return (4 * 4 + 2) * weights + 4 * originals + 3 * _hessian_bytes(members, expert_inputs)


def _hessian_bytes(members: list[StoredLinear], expert_inputs: bool) -> int:
    """A unit's float32 Hessians, one per group, as the calibration store reads them onto the CPU."""
    return sum(4 * s.in_features**2 for s in _one_per_hessian(members, expert_inputs))


def _held_by_ours(members: list[list[StoredLinear]], depth: int, expert_inputs: bool) -> int:
    """The most host memory our conversion holds at once: the unit encoding (its Hessians, read on the CPU
    and copied to the GPU, and the original of a tensor above ORIGINAL_ON_HOST_ABOVE weights, which
    exllamav3's steps keep on the CPU; a unit with a member no calibration covers goes to exllamav3's batch
    whole, quantizer/codec/exllamav3_batch.py, and holds what that does), the `depth` units prepared after
    it (their Hessians) and the results of the one before it, which the saver writes."""
    held = [_hessian_bytes(m, expert_inputs) for m in members]
    results = [sum(exl3_bytes(s.in_features, s.out_features, s.K) for s in m) for m in members]
    peak = 0
    for i, m in enumerate(members):
        if all(stored_group(s.key, s.target, expert_inputs) is not None for s in m):
            encoding = held[i] + sum(4 * s.numel for s in m if s.numel > ORIGINAL_ON_HOST_ABOVE)
        else:
            encoding = _host_bytes_cuda(m, expert_inputs)
        peak = max(peak, encoding + sum(held[i + 1:i + 1 + depth]) + (results[i - 1] if i else 0))
    return peak


def _one_per_hessian(members: list[StoredLinear], expert_inputs: bool) -> list[StoredLinear]:
    """A unit's members with one per Hessian group (calibrate/groups.py: a layer's routed gate and up
    projections share one input Hessian, or one per expert with `expert_inputs`; down projections and
    slices have their own; the drafter none)."""
    seen, out = set(), []
    for s in members:
        group = stored_group(s.key, s.target, expert_inputs)
        if group is not None and group not in seen:
            seen.add(group)
            out.append(s)
    return out


def _needs_line(work, linears, units, todo, settings, ram: int, gpu: int | None, disk: int) -> str:
    """`gpu`: the GPU memory our conversion needs (None: not modelled, exllamav3's own or the CPU)."""
    weights = sum(u.weights for u in todo)
    how = (f"exllamav3's conversion on cuda ({'our loop and tile-search kernel' if settings.encoder == 'ours' else 'its own'})"
           if settings.device == "cuda" else f"our codec on cpu ({settings.encoder} encoder)")
    if settings.device == "cuda":
        by_key = {s.key: s for s in linears}
        hours = estimate((by_key[k] for u in todo for k in u.keys), RateTable.load(encoder=settings.encoder)).gpu_hours
        how += f" (~{hours:,.2f} GPU-hours at measured rates)"
    memory = f"~{size_text(ram)} RAM" + (f", ~{size_text(gpu)} GPU memory" if gpu is not None else "")
    return (
        f"quantize: {len(linears):,} linears in {len(units):,} units, {len(units) - len(todo):,} already in the cache; "
        f"{weights:,} weights to encode with {how}; needs {memory} and ~{size_text(disk)} disk in {work / 'quantized'}"
    )

