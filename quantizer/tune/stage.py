"""The tune stage: every trunk block's EXL3 scales fitted to the native block's outputs, block by block.

Rows are split into tuning rows and held-out rows (settings.split); both go through the model one block
at a time like the streaming forward (model/streaming.py), in groups of `batch_rows` rows that each carry
their own forward state. Block L's inputs are the native model's (settings.inputs "native") or those of
the quantized blocks before it, already tuned ("quantized"); its targets are the native block's outputs
on those same inputs. A finished block's scales are saved under WORK/tuned/ (store.py) and a rerun
reuses them, so a killed run resumes at the first unfinished block.
It runs on the build's device: every row's streams, one block and its decoded codes live there
(tune_memory); on a CPU a real-size block takes about an hour (docs/tuning.md, cost at real scale).
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

from quantizer.calibrate.stage import tokens_digest
from quantizer.calibrate.unit_kl import free_memory
from quantizer.checkpoint.safetensors_file import read_tensor
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import EXL3Linear
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.streaming import CheckpointSource, block_weight_bytes, estimate_stream_memory, load_block
from quantizer.model.targets import targets
from quantizer.model.transformer import DeepseekModel
from quantizer.pack.writer import alias_of
from quantizer.plan.plan import Plan
from quantizer.plan.spec import pack_spec
from quantizer.quantize.linears import plan_units
from quantizer.quantize.results import ResultStore
from quantizer.report import gib
from quantizer.tune.block import Batch, BlockLinears, QuantizedBlock, fork, tune_block
from quantizer.tune.factor import FactoredLinear, factor
from quantizer.tune.settings import TuneSettings
from quantizer.tune.store import TunedStore, block_digest

DTYPE = torch.float32
HEAD_KEY = "head"  # the head's stored key: not in a block, tuned end to end only (end_to_end.py)
# Saved tensors of one autograd pass through a block, in multiples of one forward's peak activations
# (estimate_stream_memory). bench/tune_small.py at 16 x 512 rows measured peaks of 250 and 292 MiB
# against 210 MiB estimated with 3; with 4 the estimate is 261 MiB (docs/tuning.md).
BACKWARD_FACTOR = 4
MEMORY_SHARE = 0.9  # a tuning stage is refused up front when it needs more than this share of the free memory


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
    """Bytes the stage holds at its peak: every row's block inputs and targets (two copies of the
    streams) and two of the state (the state the block receives, forked, beside the one it advanced for
    the next block; with target "model" also the native forward's streams and state), the largest block
    three times (native, decoded codes, the weights of a step), and one autograd pass over `batch_rows` rows."""
    stream = estimate_stream_memory(cfg, rows, cols, DTYPE, rows)  # its states: one copy of streams and state
    step = estimate_stream_memory(cfg, settings.batch_rows, cols, DTYPE, settings.batch_rows)
    block = max(v for k, v in block_weight_bytes(cfg, DTYPE).items() if k.startswith("layers."))
    native_beside = stream.states if settings.target == "model" else 0  # the native forward's streams and state
    return 2 * stream.states + native_beside + 3 * block + BACKWARD_FACTOR * step.activations


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
                      "--tune holds a block three times in float32 and every row's streams",
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
    digests = _digests(layers, settings, tokens_digest(rows))
    if all(store.load(b, d, list(layers[b][0].exl3)) is not None for b, d in digests.items()):
        files = [store.path(b, d) for b, d in digests.items()]  # a rerun after a finished one: no forward
        errors = {b: (i["error_before"], i["error_after"]) for b, i in zip(digests, map(store.info, files))}
        say(f"tune: {len(files)} blocks, all reused")
        return TuneResult(files, errors, len(files), 0, n_tune, n_held, settings.record(), time.monotonic() - start)
    source = CheckpointSource(ck)
    with torch.device("meta"):
        root = DeepseekModel(cfg, DTYPE, source.engram_token_map(), with_layers=False)
    root.load_state_dict({"embed.weight": source.weight("embed.weight", DTYPE, device)}, assign=True, strict=False)
    rows = rows.to(device)
    b = settings.batch_rows
    with torch.no_grad():
        tune_in = [root.start(rows[i:min(i + b, n_tune)]) for i in range(0, n_tune, b)]
        held_in = [root.start(rows[i:i + b]) for i in range(n_tune, rows.shape[0], b)]
    by_model = settings.target == "model"  # the native model's streams run beside the quantized ones
    native_tune = [(x, fork(st)) for x, st in tune_in] if by_model else []
    native_held = [(x, fork(st)) for x, st in held_in] if by_model else []
    files, errors, tuned = [], {}, 0
    for layer in range(cfg.num_layers):
        name = f"layers.{layer}"
        block = load_block(source, layer, DTYPE, device)
        block.requires_grad_(False)
        spec = layers[name][0] if name in layers else None
        qb = QuantizedBlock(block, on_device(spec, device), root.hasher) if spec else None
        tune_t = tune_x = held_t = held_x = None  # the block before's: not alive beside this block's (tune_memory)
        if by_model:
            tune_t, _, native_tune = _targets(block, root.hasher, native_tune, "native")
            held_t, _, native_held = _targets(block, root.hasher, native_held, "native")
            tune_x, held_x = tune_in, held_in
        else:
            tune_t, tune_x, tune_in = _targets(block, root.hasher, tune_in, settings.inputs)
            held_t, held_x, held_in = _targets(block, root.hasher, held_in, settings.inputs)
        weights = None if qb is None else qb.weights()
        if qb is not None and qb.linears.exl3:
            digest = digests[name]
            keys = list(qb.linears.exl3)
            scales = store.load(name, digest, keys)
            if scales is None:
                tick = _progress(say, name, settings, cfg.num_layers - layer) if tuned == 0 else None
                r = tune_block(qb, tune_x, tune_t, held_x, held_t, settings, tick)
                info = {"error_before": r.error_before, "error_after": r.error_after, "best_step": r.best_step,
                        "steps": r.steps, "seconds": round(r.seconds, 2)}
                store.save(name, digest, {k: t.cpu() for k, t in r.scales.items()}, info)
                scales, tuned = r.scales, tuned + 1
                say(f"tune: {name}: held-out block-output MSE {r.error_before:.4g} -> {r.error_after:.4g} "
                    f"({r.error_after / max(r.error_before, 1e-30):.3f}x) after {r.steps} steps (best "
                    f"{r.best_step}), {r.seconds:.1f} s")
            else:
                info = store.info(store.path(name, digest))
            files.append(store.path(name, digest))
            errors[name] = (info["error_before"], info["error_after"])
            weights = qb.weights({k: scales[f"{k}.suh"].to(device).float() for k in keys},
                                 {k: scales[f"{k}.svh"].to(device).float() for k in keys})
        if settings.inputs == "quantized":  # the next block's inputs: this block as the pack stores it
            tune_t = held_t = None
            with torch.no_grad():
                tune_in = [(_advance(block, qb, weights, x, root.hasher), x[1]) for x in tune_x]
                held_in = [(_advance(block, qb, weights, x, root.hasher), x[1]) for x in held_x]
    say(f"tune: {len(files)} blocks, {tuned} tuned by this run, {len(files) - tuned} reused, "
        f"{time.monotonic() - start:.1f} s")
    return TuneResult(files, errors, len(files), tuned, n_tune, n_held, settings.record(), time.monotonic() - start)


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


def _digests(layers: dict[str, tuple[BlockLinears, list[str]]], settings: TuneSettings, rows_digest: str
             ) -> dict[str, str]:
    """Each tuned block's file digest, in layer order; with quantized inputs each one covers the one before."""
    out, previous = {}, None
    for name, (linears, unit_digests) in layers.items():
        if linears.exl3:
            out[name] = previous = block_digest(name, unit_digests, settings.record(), rows_digest,
                                                previous if settings.inputs == "quantized" else None)
    return out


def on_device(linears: BlockLinears, device: str) -> BlockLinears:
    """The block's stored linears with their codes, scales and fixed weights on `device`."""
    exl3 = {k: FactoredLinear(f.codes.to(device), f.suh.to(device), f.svh.to(device)) for k, f in linears.exl3.items()}
    return BlockLinears(exl3, {k: w.to(device) for k, w in linears.fixed.items()}, linears.sources)


def _advance(block, qb: QuantizedBlock | None, weights, batch: Batch, hasher) -> torch.Tensor:
    """The block as the pack stores it (native where the pack keeps it native) on `batch`, advancing its state."""
    return qb.run(batch, weights, advance=True) if qb else block(*batch, hasher)


def _progress(say, name: str, settings: TuneSettings, blocks_left: int):
    """After the first measured steps of the first block tuned: the time all blocks left need at most."""
    def tick(step: int, seconds: float) -> None:
        if step == settings.eval_every:
            per = seconds / step
            say(f"tune: {name}: {per:.2f} s per step measured; at most {settings.steps} steps x {blocks_left} "
                f"block(s) = about {per * settings.steps * blocks_left / 60:.1f} min (early stopping shortens it)")
    return tick


def stored_linears(ck: Checkpoint, plan: Plan, quantize_work: Path, job: dict
                   ) -> dict[str, tuple[BlockLinears, list[str]]]:
    """Per trunk block (`layers.L`), and `head` when the pack encodes it: its stored linears from the
    quantize stage's unit store, and their unit digests. The drafter's are left out: no forward runs it."""
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
            fixed[block][s.key] = read_tensor(entries[f"{s.key}.weight"]).float()
        else:
            leaves = {n: read_tensor(entries[n]) for n in (f"{s.key}.{leaf}" for leaf in ("trellis", "suh", "svh",
                                                                                           "mul1", "mcg")) if n in entries}
            exl3[block][s.key] = factor(EXL3Linear.from_tensors(leaves, s.key))
        sources[block].setdefault(f"{s.target.key}.weight", []).append(s.key)
    for t in targets(ck.config):
        warm = alias_of(plan, t.key)
        if warm and t.layer is not None and t.key.startswith("layers."):
            block = ".".join(t.key.split(".")[:2])
            sources[block][f"{t.key}.weight"] = sources[block][f"{warm}.weight"]
    return {b: (BlockLinears(exl3[b], fixed[b], sources[b]), sorted(digests[b])) for b in sources}
