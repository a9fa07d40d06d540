"""The tune stage: every trunk block's EXL3 scales fitted to the native block's outputs, block by block.

Rows are split into tuning rows and held-out rows (settings.split); both go through the model one block
at a time like the streaming forward (model/streaming.py), in groups of `batch_rows` rows that each carry
their own forward state. Block L's inputs are the native model's (settings.inputs "native") or those of
the quantized blocks before it, already tuned ("quantized"); its targets are the native block's outputs
on those same inputs. A finished block's scales are saved under WORK/tuned/ (store.py) and a rerun
reuses them, so a killed run resumes at the first unfinished block.
It runs on the build's device: the rows' streams and one block live there, the block's native weights
while its targets are computed, then its decoded codes in their place (tune_memory). Blocks are read and
decoded one at a time, so the stage streams the model like every other.
The drafter (`mtp.*`) and the head are not tuned here: our forward has no drafter, and the head is no
block (end_to_end.py tunes it).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantizer.calibrate.stage import tokens_digest
from quantizer.calibrate.unit_kl import free_memory
from quantizer.checkpoint.safetensors_file import TensorEntry, read_tensor
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import EXL3Linear
from quantizer.contract.pack_spec import alias_of, pack_spec
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.linear import NativeLinear
from quantizer.model.streaming import CheckpointSource, block_weight_bytes, estimate_stream_memory, load_block
from quantizer.model.targets import targets
from quantizer.model.transformer import DeepseekModel
from quantizer.quantize.linears import plan_units
from quantizer.quantize.results import ResultStore
from quantizer.report import GIB, gib
from quantizer.tune.block import Batch, BlockLinears, QuantizedBlock, fork, join_linears, tune_block
from quantizer.tune.factor import factor, unit_scaled
from quantizer.tune.settings import TuneSettings
from quantizer.tune.store import TunedStore, block_digest, run_record

DTYPE = torch.float32
STAGE = "tune"  # its name in WORK/tuned/<stage>.done.json (store.finished) and in the build's messages
HEAD_KEY = "head"  # the head's stored key: not in a block, tuned end to end only (end_to_end.py)
# Saved tensors of one autograd pass through a block, in multiples of one forward's peak activations
# (estimate_stream_memory). bench/tune_small.py at 16 x 512 rows measured peaks of 250 and 292 MiB
# against 210 MiB estimated with 3; with 4 the estimate is 261 MiB (docs/tuning.md).
BACKWARD_FACTOR = 4
MEMORY_SHARE = 0.9  # a tuning stage is refused up front when it needs more than this share of the free memory
# One block's tuning on one H200, measured by bench/tune_block_gpu.py (docs/tuning.md) on V4.1-Flash blocks
# of 48 and 384 routed experts (7.0 and 51.3 GiB of float32 weights), 2048-token rows: seconds of the native
# block's forward per row, and an Adam step's forward and backward per row in such forwards (the many small
# expert products of a real block make both grow with it); decoding the codes, per GiB of the block. And from
# bench/rehearsal.py --tune (the stage in a build, a full-width slice): reading a block from the checkpoint
# (in the page cache), per GiB of its float32 weights, and the stage's start with its first backward pass.
MEASURED_BLOCK_GIB = (7.0, 51.3)
ROW_FORWARD_S = (0.0545, 0.085)
STEP_FORWARDS = (2.75, 4.56)
DECODE_S_PER_GIB = 0.043
READ_S_PER_GIB = 0.075
START_S = 9.0
MEASURED_COLS = 2048


@dataclass(frozen=True)
class TuneResult:
    files: list[Path]  # the tuned blocks' files, in layer order
    errors: dict[str, tuple[float, float]]  # block -> held-out block-output MSE (stored scales, tuned)
    blocks: int
    tuned: int  # blocks tuned by this run (the others were reused)
    tune_rows: int
    heldout_rows: int
    settings: dict
    seconds: float

    def record(self) -> dict:
        """What the manifest keeps: the settings, the row split, and the held-out error ratio per block."""
        return {**self.settings, "tune_rows": self.tune_rows, "heldout_rows": self.heldout_rows,
                "heldout_error_ratio": {b: round(a / max(e, 1e-30), 4) for b, (e, a) in self.errors.items()}}


def tune_memory(cfg, rows: int, cols: int, settings: TuneSettings) -> int:
    """Bytes the stage holds at its peak for `rows` calibration rows (of which settings.split uses some):
    the used rows' block inputs and targets (two copies of the streams) and two of the state (the state
    the block receives, forked, beside the one it advanced for the next block; with target "model" also
    the native forward's streams and state), the largest block once in float32 (its native weights, then
    its decoded codes in their place), the embedding the rows start from, and one autograd pass over
    `batch_rows` rows."""
    used = sum(settings.split(rows))
    stream = estimate_stream_memory(cfg, used, cols, DTYPE, used)  # its states: one copy of streams and state
    step = estimate_stream_memory(cfg, settings.batch_rows, cols, DTYPE, settings.batch_rows)
    block = max(v for k, v in block_weight_bytes(cfg, DTYPE).items() if k.startswith("layers."))
    native_beside = stream.states if settings.target == "model" else 0  # the native forward's streams and state
    embed = cfg.vocab_size * cfg.hidden_size * torch.finfo(DTYPE).bits // 8
    return 2 * stream.states + native_beside + block + embed + BACKWARD_FACTOR * step.activations


def tune_seconds(cfg, rows: int, cols: int, settings: TuneSettings) -> float:
    """Seconds the stage takes on one H200 at most (no early stop: every step and held-out measurement paid)."""
    return START_S + sum(block_seconds(size, rows, cols, settings) for name, size in block_weight_bytes(cfg, DTYPE).items()
                         if name.startswith("layers."))


def block_seconds(block_bytes: int, rows: int, cols: int, settings: TuneSettings) -> float:
    """One block of `block_bytes` float32 weights at most: reading it, its targets (a forward of every row
    used), the codes' decoding, `steps` Adam steps and the held-out measurements, at the measured rates
    above, interpolated in the block's size."""
    n_tune, n_held = settings.split(rows)
    evals = 1 + settings.steps // settings.eval_every + (settings.steps % settings.eval_every > 0)
    gib = block_bytes / GIB
    row = _interpolate(gib, ROW_FORWARD_S) * cols / MEASURED_COLS
    forwards = n_tune + n_held + settings.steps * settings.batch_rows * _interpolate(gib, STEP_FORWARDS)
    return row * (forwards + evals * n_held) + (DECODE_S_PER_GIB + READ_S_PER_GIB) * gib


def _interpolate(gib: float, values: tuple[float, float]) -> float:
    """A measured rate at a block of `gib`, on the line through the two measured blocks (never below the smaller's half)."""
    (g0, g1), (v0, v1) = MEASURED_BLOCK_GIB, values
    return max(v0 / 2, v0 + (v1 - v0) * (gib - g0) / (g1 - g0))


def tune_line(cfg, rows: int, cols: int, settings: TuneSettings, ranks: tuple[int, ...] = (1, 8)) -> str:
    """What `plan` and `build` state of the stage's time; it runs on one GPU while a job's other ranks wait,
    so a job of g GPUs holds g times its hours."""
    hours = tune_seconds(cfg, rows, cols, settings) / 3600
    held = ", ".join(f"{hours * g:,.2f} on {g} GPU{'s' if g > 1 else ''}" for g in ranks)
    return (f"tune (--tune): at most {hours:,.2f} h on one H200 at measured rates ({cfg.num_layers} blocks, "
            f"{settings.steps} steps each on {sum(settings.split(rows))} of {rows} rows x {cols}); it runs on one "
            f"GPU while a job's others wait, GPU-hours held: {held}")


def check_fits(needs: int, device: str, what: str, instead: str) -> int:
    """`needs`, or a refusal naming it against the free memory of `device` (a tuning stage runs after
    calibration and quantize, so a build that cannot hold it is refused before those hours)."""
    free = free_memory(device)
    if needs > MEMORY_SHARE * free:
        raise UserError(f"{what}: about {gib(needs)} GiB of {'RAM' if device == 'cpu' else device + ' memory'}, "
                        f"{gib(free)} GiB free; {instead}")
    return needs


def check_tune_fits(cfg, rows: int, cols: int, settings: TuneSettings, device: str = "cpu") -> int:
    """The block-wise stage's memory on `device`, or a refusal."""
    return check_fits(tune_memory(cfg, rows, cols, settings), device,
                      "--tune holds a block in float32 and the streams of the rows it uses",
                      "drop --tune, or use fewer or shorter calibration rows (--calib-rows, --calib-cols)")


def tune(ck: Checkpoint, plan: Plan, quantize_work: Path, work: Path, rows: torch.Tensor, settings: TuneSettings,
         job: dict, say: Callable[[str], None] | None = None, device: str = "cpu") -> TuneResult:
    """Tune every trunk block of `plan`'s pack whose EXL3 linears the quantize stage finished in
    `quantize_work` (made under `job`, its settings record), on `device`; results under `work`/tuned."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    cfg = ck.config
    n_tune, n_held = settings.split(rows.shape[0])
    say(f"tune: {n_tune} tuning + {n_held} held-out rows x {rows.shape[1]} tokens, up to {settings.steps} Adam steps "
        f"per block, inputs {settings.inputs}; needs about {gib(tune_memory(cfg, *rows.shape, settings))} GiB on {device}")
    layers = {b: v for b, v in stored_linears(ck, plan, quantize_work, job).items() if b != HEAD_KEY}
    store = TunedStore(work)
    store.drop_unfinished()
    rows_digest = tokens_digest(rows)
    digests = _digests(layers, settings, rows_digest)
    done_record = run_record(settings.record(), rows_digest)
    if all(store.load(b, d, list(layers[b].exl3)) is not None for b, d in digests.items()):
        files = [store.path(b, d) for b, d in digests.items()]  # a rerun after a finished one: no forward
        errors = {b: (i["error_before"], i["error_after"]) for b, i in zip(digests, map(store.info, files))}
        say(f"tune: {len(files)} blocks, all reused")
        store.mark_finished(STAGE, done_record)
        return TuneResult(files, errors, len(files), 0, n_tune, n_held, settings.record(), time.monotonic() - start)
    check_tune_fits(cfg, *rows.shape, settings, device)  # build skipped it for a rerun of a finished stage
    source = CheckpointSource(ck)
    with torch.device("meta"):
        root = DeepseekModel(cfg, DTYPE, source.engram_token_map(), with_layers=False)
    root.load_state_dict({"embed.weight": source.weight("embed.weight", DTYPE, device)}, assign=True, strict=False)
    rows = rows.to(device)
    b = settings.batch_rows
    with torch.no_grad():
        tune_in = [root.start(rows[i:min(i + b, n_tune)]) for i in range(0, n_tune, b)]
        held_in = [root.start(rows[i:i + b]) for i in range(rows.shape[0] - n_held, rows.shape[0], b)]
    by_model = settings.target == "model"  # the native model's streams run beside the quantized ones
    native_tune = [(x, fork(st)) for x, st in tune_in] if by_model else []
    native_held = [(x, fork(st)) for x, st in held_in] if by_model else []
    files, errors, tuned = [], {}, 0
    for layer in range(cfg.num_layers):
        name = f"layers.{layer}"
        lap = _Laps(device)
        block = load_block(source, layer, DTYPE, device)
        block.requires_grad_(False)
        lap("read_s")
        tune_t = tune_x = held_t = held_x = None  # the block before's: not alive beside this block's (tune_memory)
        if by_model:
            tune_t, _, native_tune = _targets(block, root.hasher, native_tune, "native")
            held_t, _, native_held = _targets(block, root.hasher, native_held, "native")
            tune_x, held_x = tune_in, held_in
        else:
            tune_t, tune_x, tune_in = _targets(block, root.hasher, tune_in, settings.inputs)
            held_t, held_x, held_in = _targets(block, root.hasher, held_in, settings.inputs)
        lap("targets_s")
        qb = None
        if name in layers:  # the native weights gave the targets; the stored linears take their place
            drop_native_weights(block, set(layers[name].sources))
            qb = QuantizedBlock(block, layers[name].load(device), root.hasher)
            lap("codes_s")
        hooks = None if qb is None else qb.hooks()
        if qb is not None and qb.linears.exl3:
            digest = digests[name]
            keys = list(qb.linears.exl3)
            scales = store.load(name, digest, keys)
            if scales is None:
                tick = _progress(say, name, settings, cfg.num_layers - layer) if tuned == 0 else None
                r = tune_block(qb, tune_x, tune_t, held_x, held_t, settings, tick)
                info = {"error_before": r.error_before, "error_after": r.error_after, "best_step": r.best_step,
                        "steps": r.steps, "seconds": round(r.seconds, 2), "held_s": round(r.held_seconds, 2),
                        **{k: round(v, 2) for k, v in lap.parts.items()}}
                store.save(name, digest, {k: t.cpu() for k, t in r.scales.items()}, info)
                scales, tuned = r.scales, tuned + 1
                say(f"tune: {name}: held-out block-output MSE {r.error_before:.4g} -> {r.error_after:.4g} "
                    f"({r.error_after / max(r.error_before, 1e-30):.3f}x) after {r.steps} steps (best "
                    f"{r.best_step}), {r.seconds:.1f} s ({r.held_seconds:.1f} s of it held-out measurements); "
                    f"block read {lap.parts['read_s']:.1f} s, targets {lap.parts['targets_s']:.1f} s, "
                    f"codes {lap.parts['codes_s']:.1f} s")
            else:
                info = store.info(store.path(name, digest))
            files.append(store.path(name, digest))
            errors[name] = (info["error_before"], info["error_after"])
            hooks = qb.hooks({k: scales[f"{k}.suh"].to(device).float() for k in keys},
                             {k: scales[f"{k}.svh"].to(device).float() for k in keys})
        if settings.inputs == "quantized":  # the next block's inputs: this block as the pack stores it
            tune_t = held_t = None
            with torch.no_grad():
                tune_in = [(_advance(block, qb, hooks, x, root.hasher), x[1]) for x in tune_x]
                held_in = [(_advance(block, qb, hooks, x, root.hasher), x[1]) for x in held_x]
    say(f"tune: {len(files)} blocks, {tuned} tuned by this run, {len(files) - tuned} reused, "
        f"{time.monotonic() - start:.1f} s")
    store.mark_finished(STAGE, done_record)
    return TuneResult(files, errors, len(files), tuned, n_tune, n_held, settings.record(), time.monotonic() - start)


class _Laps:
    """Seconds between calls, by name (the device's queued work finished first, so GPU time lands where it is spent)."""

    def __init__(self, device: str):
        self.device, self.parts, self.last = device, {}, time.monotonic()

    def __call__(self, name: str) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        self.parts[name], self.last = now - self.last, now


def _targets(block, hasher, batches: list[Batch], inputs: str
             ) -> tuple[list[torch.Tensor], list[Batch], list[Batch] | None]:
    """The native block's outputs on `batches`, the batches as the block receives them, and (native
    inputs) the next block's inputs: these outputs with the states the native block advanced."""
    with torch.no_grad():
        if inputs == "native":
            received = [(s, fork(st)) for s, st in batches]
            out = [block(s, st, hasher) for s, st in batches]
            return out, received, [(o, st) for o, (_, st) in zip(out, batches)]
        return [block(s, fork(st), hasher) for s, st in batches], batches, None


def _digests(layers: dict[str, StoredBlock], settings: TuneSettings, rows_digest: str) -> dict[str, str]:
    """Each tuned block's file digest, in layer order; with quantized inputs each one covers the one before."""
    out, previous = {}, None
    for name, stored in layers.items():
        if stored.exl3:
            out[name] = previous = block_digest(name, stored.digests, settings.record(), rows_digest,
                                                previous if settings.inputs == "quantized" else None)
    return out


def drop_native_weights(block: nn.Module, names: set[str]) -> None:
    """Free the native weights `names` (their stored linears replace them once the targets are computed), so
    the decoded codes take their place in memory instead of sitting beside them. A forward that still
    reached one would fail on its empty weight rather than run it."""
    for module in block.modules():
        if isinstance(module, NativeLinear) and module.native_name in names:
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def _advance(block, qb: QuantizedBlock | None, hooks, batch: Batch, hasher) -> torch.Tensor:
    """The block as the pack stores it (native where the pack keeps it native) on `batch`, advancing its state."""
    return qb.run(batch, hooks, advance=True) if qb else block(*batch, hasher)


def _progress(say, name: str, settings: TuneSettings, blocks_left: int):
    """After the first measured steps of the first block tuned: the time all blocks left need at most."""
    def tick(step: int, seconds: float) -> None:
        if step == settings.eval_every:
            per = seconds / step
            say(f"tune: {name}: {per:.2f} s per step measured; at most {settings.steps} steps x {blocks_left} "
                f"block(s) = about {per * settings.steps * blocks_left / 60:.1f} min (early stopping shortens it)")
    return tick


@dataclass(frozen=True)
class StoredBlock:
    """One block's (or the head's) stored linears as the quantize stage left them, not read yet: tensor
    entries by stored key, per native weight name the stored keys it is made of (wo_a: its slices), and
    the units' digests. `load` reads and decodes them, one block at a time."""

    exl3: dict[str, dict[str, TensorEntry]]  # stored key -> its EXL3 leaves (trellis, suh, svh, codebook marker)
    fixed: dict[str, TensorEntry]  # stored key -> its fp16 weight (K 16)
    sources: dict[str, list[str]]
    digests: list[str]

    def load(self, device: str) -> BlockLinears:
        """The linears on `device`, each EXL3 one decoded there to its codes (join_linears)."""
        def read(entry: TensorEntry) -> torch.Tensor:
            return read_tensor(entry).to(device)

        exl3 = {k: factor(EXL3Linear.from_tensors({n: read(e) for n, e in leaves.items()}, k))
                for k, leaves in self.exl3.items()}
        fixed = {k: unit_scaled(read(e)) for k, e in self.fixed.items()}
        return join_linears(exl3, fixed, self.sources)


def stored_linears(ck: Checkpoint, plan: Plan, quantize_work: Path, job: dict) -> dict[str, StoredBlock]:
    """Per trunk block (`layers.L`), and `head` when the pack encodes it: its stored linears in the quantize
    stage's unit store. The drafter's are left out: no forward runs it."""
    spec = pack_spec(ck.config, plan)
    units = plan_units(spec, plan.codebook, job)
    unit_of = {k: u.digest for u in units for k in u.keys}
    entries = ResultStore(quantize_work).entries(units)
    exl3, fixed, sources, digests = defaultdict(dict), defaultdict(dict), defaultdict(dict), defaultdict(set)
    for s in spec.encoded:
        if not s.key.startswith("layers.") and s.key != HEAD_KEY:
            continue  # the drafter
        block = HEAD_KEY if s.key == HEAD_KEY else ".".join(s.key.split(".")[:2])
        digests[block].add(unit_of[s.key])
        if s.K == UNQUANTIZED:
            fixed[block][s.key] = entries[f"{s.key}.weight"]
        else:
            exl3[block][s.key] = {n: entries[n] for n in (f"{s.key}.{leaf}" for leaf in ("trellis", "suh", "svh",
                                                                                          "mul1", "mcg")) if n in entries}
        sources[block].setdefault(f"{s.target.key}.weight", []).append(s.key)
    for t in targets(ck.config):
        warm = alias_of(plan, t.key)
        if warm and t.layer is not None and t.key.startswith("layers."):
            block = ".".join(t.key.split(".")[:2])
            sources[block][f"{t.key}.weight"] = sources[block][f"{warm}.weight"]
    return {b: StoredBlock(exl3[b], fixed[b], sources[b], sorted(digests[b])) for b in sources}
