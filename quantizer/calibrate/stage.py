"""The calibrate stage: token rows streamed through the native model, one block at a time, resumably.

For each trunk layer: load the block, push every row chunk through it with hooks that collect the
layer's input Hessians, routing and site gains (collect.py), compute the per-tensor statistics while
the weights are loaded, save the layer's file, then save the streams after it (the resume point).
After the last layer the head's Hessian comes from the final hidden, and the summary is written.
Then, where the dequantized model fits in memory (or when asked), each layer unit's KL sensitivity
is measured by noise injection (unit_kl.py) and added to the summary; a summary without it is
completed by the next run.
Kill it at any moment and rerun the same command: it continues from the next layer and produces the
same files as an uninterrupted run. A rerun with another source, other tokens or other settings is
refused with the difference named.
Under torchrun the row chunks are split over the ranks (data-parallel; collect.py reduces each layer
to rank 0, which writes the layer's file); the files are the same for any number of ranks, and a run
killed with one number of ranks resumes with another. Rank 0 alone measures the unit KL.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from quantizer import __version__
from quantizer.calibrate.analysis import ldlq_factor, out_energy
from quantizer.calibrate.collect import LayerCollector, accumulate
from quantizer.calibrate.groups import HEAD_KEY, head_group
from quantizer.calibrate.duration import calibration_line, unit_kl_line
from quantizer.calibrate.needs import calibration_needs
from quantizer.calibrate.resume import drop_resume_points, load_chunk, resume_point, save_chunk
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.storage import (
    CALIBRATION_DIR,
    HEAD_FILE,
    SUMMARY_FILE,
    HessianStore,
    layer_file,
    pack_hessian,
    read_meta,
    write_stats_file,
)
from quantizer.calibrate.summary import MEASURED_KL, CalibrationSummary, LayerStats, TensorStats
from quantizer.calibrate.unit_kl import (
    fits,
    free_memory,
    kl_relative_error,
    measure_unit_kl,
    probe_rows,
    unit_kl_needs,
)
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.distributed import Ranks, current
from quantizer.errors import UserError
from quantizer.model.state import DEFAULT_ATTN_CHUNK_ELEMENTS, ForwardState
from quantizer.model.streaming import CheckpointSource, load_block
from quantizer.model.transformer import DeepseekModel
from quantizer.report import gib
from quantizer.workdir import (
    FINGERPRINT_CACHE,
    claim_work_dir,
    open_job,
    require_free_space,
    settings_differences,
    source_difference,
)


@dataclass(frozen=True)
class CalibrationResult:
    directory: Path  # WORK/calibration
    summary: CalibrationSummary
    fingerprint: str  # of this calibration (source, tokens, settings)
    resumed_layers: int  # layers finished before this run
    seconds: float
    unit_kl_seconds: float = 0.0  # of `seconds`, the unit KL probe's (bench/calibrate_cpu.py times the two apart)


def tokens_digest(rows: torch.Tensor) -> str:
    return hashlib.sha256(rows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def job_record(ck: Checkpoint, rows: torch.Tensor, settings: CalibrationSettings, directory: Path) -> dict:
    """What job.json pins; `fingerprint` hashes all of it but the source path (a moved checkpoint is
    the same checkpoint). The source's shard hashes are kept in `directory`."""
    record = {
        "source": {"path": str(ck.root), "fingerprint": source_fingerprint(ck, directory / FINGERPRINT_CACHE)},
        "tokens": {"rows": int(rows.shape[0]), "cols": int(rows.shape[1]),
                   "sha256": tokens_digest(rows)},
        "settings": {**settings.record(), "quantizer_version": __version__},
    }
    pinned = {"source": record["source"]["fingerprint"], "tokens": record["tokens"], "settings": record["settings"]}
    record["fingerprint"] = "sha256:" + hashlib.sha256(json.dumps(pinned, sort_keys=True).encode()).hexdigest()
    return record


def record_differences(old: dict, new: dict) -> list[str]:
    out = source_difference(old["source"], new["source"])
    for field in ("rows", "cols"):
        if old["tokens"][field] != new["tokens"][field]:
            out.append(f"{field} differ: {old['tokens'][field]} -> {new['tokens'][field]}")
    if not out and old["tokens"]["sha256"] != new["tokens"]["sha256"]:
        out.append("calibration tokens differ (another text or token file)")
    return out + settings_differences(old["settings"], new["settings"])


def calibrate(ck: Checkpoint, rows: torch.Tensor, work: str | Path,
              settings: CalibrationSettings = CalibrationSettings(), progress: bool = True,
              resume_every: int = 1) -> CalibrationResult:
    """Calibrate `ck` on token rows [rows, cols] into WORK/calibration (see the module docstring).

    resume_every: save the resume point after every this many layers (it holds every row's hc streams
    and forward state: tens of GB for the real model); a resumed run redoes the layers after the last
    one. It changes no result, so a rerun may use another value."""
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    if resume_every < 1:
        raise UserError(f"--resume-every {resume_every}: must be at least 1")
    current().on_main(lambda: claim_work_dir(Path(work)))
    directory = Path(work) / CALIBRATION_DIR
    ranks = current()
    with ranks.lock(directory):
        # rank 0 hashes the source (its shard hashes kept in `directory`) and checks the job
        record = ranks.on_main(lambda: job_record(ck, rows, settings, directory))
        ranks.on_main(lambda: open_job(directory, record, record_differences, "calibration"))
        start = time.monotonic()
        chunks = _chunks(rows, settings)
        resumed = ranks.on_main(lambda: _finished_layers(directory, ck.config.num_layers, len(chunks)))
        needs = calibration_needs(ck.config, rows.shape[0], rows.shape[1], settings)
        if ranks.main:
            print(_start_line(ck.config, rows, settings, resumed, directory), file=sys.stderr)
            if resumed < ck.config.num_layers:
                print(needs.describe(settings.device), file=sys.stderr)
        written = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        ranks.on_main(lambda: require_free_space(directory, needs.disk - written, "the calibration"))
        if resumed < ck.config.num_layers:
            _run(ck, chunks, directory, settings, record, progress, resume_every, resumed, ranks)
            ranks.barrier()  # rank 0 has written the summary
        summary = CalibrationSummary.load(directory / SUMMARY_FILE)
        probe_start = time.monotonic()
        if summary.gains != MEASURED_KL and settings.measure_kl is not False:
            summary = ranks.on_main(lambda: _unit_kl(ck, rows, work, settings, summary, progress))
        end = time.monotonic()
        return CalibrationResult(directory, summary, record["fingerprint"], resumed, end - start, end - probe_start)


def _start_line(cfg: ModelConfig, rows: torch.Tensor, settings: CalibrationSettings, resumed: int,
                directory: Path) -> str:
    """Before any layer runs: the rows and about how long they take here, or that the work directory's
    calibration of these rows is reused (whole, or from the layer a stopped run reached)."""
    R, C = rows.shape
    if resumed == cfg.num_layers:
        return f"calibrate: reusing the finished calibration of {R:,} rows x {C:,} tokens in {directory}"
    line = calibration_line(cfg, R, C, settings)
    return line + (f"; resuming: {resumed} of its {cfg.num_layers} layers are done" if resumed else "")


def _unit_kl(ck: Checkpoint, rows: torch.Tensor, work: Path, settings: CalibrationSettings,
             summary: CalibrationSummary, progress: bool) -> CalibrationSummary:
    """The summary with every layer's measured unit KL, saved; unchanged where the model does not fit
    in memory and the measurement was not asked for (UserError where it was)."""
    tokens = probe_rows(rows, settings.kl_rows, settings.kl_cols)
    needs, free = unit_kl_needs(ck.config, *tokens.shape, settings.dtype), free_memory(settings.device)
    if not fits(needs, free):
        where = "RAM" if settings.device == "cpu" else "GPU memory"
        line = (f"the unit KL probe holds the dequantized model: ~{gib(needs)} GiB, more than half the "
                f"{gib(free)} GiB of free {where}")
        if settings.measure_kl:
            raise UserError(f"--measure-kl: {line}; calibrate without it (stream-energy site gains)")
        print(f"calibrate: {line}; the summary carries stream-energy site gains", file=sys.stderr)
        return summary
    print(unit_kl_line(ck.config, *tokens.shape, settings.device), file=sys.stderr, flush=True)
    start = time.monotonic()
    model = DeepseekModel.from_checkpoint(ck, settings.dtype, settings.device)
    store = HessianStore(work, ck)

    def mean_hessian(key: str) -> torch.Tensor | None:
        found = store.hessian(key)
        return None if found is None else found[0] / found[1]

    measured = measure_unit_kl(model, tokens.to(settings.device), summary.tensors, mean_hessian, progress)
    for layer in summary.layers:
        layer.unit_kl = measured.get(layer.layer, {})
    summary.kl_relative_error, (summary.kl_rows, summary.kl_cols) = kl_relative_error(), tuple(tokens.shape)
    summary.save(Path(work) / CALIBRATION_DIR / SUMMARY_FILE)
    print(f"calibrate: unit KL measured on {tokens.shape[0]} x {tokens.shape[1]} tokens in "
          f"{time.monotonic() - start:.1f} s", file=sys.stderr)
    return summary


def _chunks(rows: torch.Tensor, settings: CalibrationSettings) -> list[torch.Tensor]:
    """The row chunks pushed through a block together, the same for any number of ranks."""
    step = settings.chunk_rows(rows.shape[0], rows.shape[1])
    return [rows[i:i + step] for i in range(0, rows.shape[0], step)]


def _finished_layers(directory: Path, layers: int, chunks: int) -> int:
    return layers if (directory / SUMMARY_FILE).exists() else resume_point(directory, chunks)


@torch.no_grad()
def _run(ck: Checkpoint, chunks: list[torch.Tensor], directory: Path, settings: CalibrationSettings, record: dict,
         progress: bool, resume_every: int, first: int, ranks: Ranks) -> None:
    """Layers `first`.. over this rank's row chunks (all of them with one rank)."""
    cfg, device, dtype = ck.config, torch.device(settings.device), settings.dtype
    source = CheckpointSource(ck)
    with torch.device("meta"):
        root = DeepseekModel(cfg, dtype, source.engram_token_map(), with_layers=False)
    mine = ranks.contiguous(len(chunks))
    if first:
        parts = [load_chunk(directory, first, c, ForwardState.start(cfg, chunks[c].to(device), dtype,
                                                                    DEFAULT_ATTN_CHUNK_ELEMENTS), device)
                 for c in mine]
    else:
        _load_root(root, source, ["embed.weight"], device)
        parts = [root.start(chunks[c].to(device), DEFAULT_ATTN_CHUNK_ELEMENTS) for c in mine]
        root.embed.to("meta")
    tokens = sum(c.numel() for c in chunks)
    bar = tqdm(range(first, cfg.num_layers), initial=first, total=cfg.num_layers, desc="calibrate",
               unit="layer", disable=not progress or not ranks.main)
    for layer in bar:
        block = load_block(source, layer, dtype, device)
        collector = LayerCollector(cfg, layer, settings, tokens, len(chunks), device, ranks, mine.start)
        collector.run(block, parts, root.hasher)
        collector.reduce()
        if ranks.main:
            result = collector.finish(block)
            write_stats_file(directory / layer_file(layer), result.hessians, result.meta())
        collector.hooks = None  # bound to the collector: without this cycle its kept inputs go at once, not at a GC
        del block, collector
        if (layer + 1) % resume_every == 0 and layer + 1 < cfg.num_layers:  # the head follows the last at once
            for c, part in zip(mine, parts):
                save_chunk(directory, layer + 1, c, part)
            ranks.barrier()  # every chunk is saved: the older resume point can go
            if ranks.main:
                drop_resume_points(directory, keep=layer + 1)
    bar.close()
    if head_group(cfg) is not None:
        _load_root(root, source, [k for k in root.state_dict() if k != "embed.weight"], device)
        _head(root, source, parts, directory, tokens, device, ranks)
    if ranks.main:
        shape = (sum(len(c) for c in chunks), chunks[0].shape[1])
        summarize(directory, cfg.num_layers, record, shape).save(directory / SUMMARY_FILE)
        drop_resume_points(directory)


def _load_root(root: DeepseekModel, source: CheckpointSource, names, device) -> None:
    types = root.state_dict()
    root.load_state_dict({k: source.weight(k, types[k].dtype, device) for k in names}, assign=True, strict=False)


def _head(root: DeepseekModel, source: CheckpointSource, parts, directory: Path, tokens: int, device,
          ranks: Ranks) -> None:
    """The head's H from the final hidden (as the head reads it) and its statistics, on rank 0."""
    cfg = root.cfg
    total = torch.zeros(cfg.hidden_size, cfg.hidden_size, dtype=torch.float64, device=device)
    for streams, state in parts:
        accumulate(total, root.final_hidden(streams, state).to(root.dtype).reshape(-1, cfg.hidden_size))
    ranks.sum_to_main(total)
    if not ranks.main:
        return
    mean = total.float().div_(tokens)
    weight = source.weight("head.weight", root.dtype, device)
    stats = TensorStats(float(tokens), out_energy(weight, mean), ldlq_factor(mean))
    meta = {"counts": {HEAD_KEY: float(tokens)}, "tensors": {HEAD_KEY: asdict(stats)}}
    write_stats_file(directory / HEAD_FILE, pack_hessian(HEAD_KEY, mean, torch.float32), meta)


def summarize(directory: Path, layers: int, record: dict, shape) -> CalibrationSummary:
    """The allocator's summary from the saved layer and head files."""
    tensors: dict[str, TensorStats] = {}
    layer_stats: list[LayerStats] = []
    head = [directory / HEAD_FILE] if (directory / HEAD_FILE).exists() else []
    for path in [directory / layer_file(layer) for layer in range(layers)] + head:
        meta = read_meta(path)
        tensors.update({k: TensorStats(**v) for k, v in meta["tensors"].items()})
        if "layer" in meta:
            layer_stats.append(LayerStats.from_dict(meta["layer"]))
    return CalibrationSummary(record["source"]["fingerprint"], int(shape[0]), int(shape[1]), tensors, layer_stats)
