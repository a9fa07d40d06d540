"""End-to-end tuning (`build --tune-e2e`): every EXL3 scale of the trunk and the head fitted together to
the native model's next-token distributions.

Block-wise tuning (stage.py) fits each block to its own native outputs; what the model loses is what the
blocks' errors do to the logits, through routing, the blocks after and the head. This stage minimises
that directly: Adam on KL(native || quantized) over the tuning rows, starting from the block-wise scales
when that stage ran (else the stored ones), with every EXL3 linear the forward uses applied as its codes
and scales, `svh * linear(x * suh, M)` (factor.py), in the whole model at once. As block-wise
(scales.py), each scale moves as a relative change, held-out rows are measured with the scales rounded
to fp16 as stored every `eval_every` steps, and the best measurement wins, the starting scales included:
the stage never leaves the held-out KL higher than it found it. Codes, norms, router, mHC and every
native tensor stay as they are.

Cost: the whole model is in memory on the build's device (each encoded linear's float32 codes in place of
its native weight once the native log-probabilities of every row are computed), those log-probabilities,
and one autograd pass through all blocks (`end_to_end_needs`).
That is for small models: the stage refuses, before any other stage runs, where it would not fit, and a
real V4.1 build tunes block-wise only (docs/tuning.md gives the sizes).
The result is one file, WORK/tuned/model.<digest>.safetensors (tune/store.py), reused by a rerun.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from quantizer.calibrate.stage import tokens_digest
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import TensorEntry, read_tensor
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.plan import Plan
from quantizer.model.hooks import ForwardHooks, ScaledCodes
from quantizer.model.streaming import block_activations, model_bytes
from quantizer.model.transformer import DeepseekModel
from quantizer.report import gib
from quantizer.tune.block import BlockLinears, scaled_hooks
from quantizer.tune.scales import BestHeldOut, RelativeScales
from quantizer.tune.settings import EndToEndSettings
from quantizer.tune.stage import DTYPE, StoredBlock, check_fits, drop_native_weights, stored_linears
from quantizer.tune.store import TunedStore, block_digest, run_record

MODEL_FILE = "model"  # WORK/tuned/model.<digest>.safetensors
STAGE = "tune-e2e"  # WORK/tuned/tune-e2e.done.json (store.finished)
# What autograd keeps of one block for the backward, in multiples of the block's forward peak
# (block_activations): every intermediate of attention, MoE and mHC, not just the largest moment's.
# Fitted with bench/tune_small.py --device cuda on the small V4 model (1 row x 2048 tokens a step): 4.5
# times the blocks' summed forward peaks. Re-measured there since the scales act on activations: 1965 MiB
# stated against a 2103 MiB peak (0.93x); docs/tuning.md has that and the CPU check (0.87-0.92x).
SAVED_PER_BLOCK = 4.5
# Per vocabulary entry of a training row's token: its logits, their log-softmax and the gradient of each,
# and the native log-probabilities' exp and the product with the difference (float32)
LOGIT_BYTES = 6 * 4


@dataclass(frozen=True)
class EndToEndResult:
    file: Path
    kl_before: float  # held-out KL(native || pack) with the scales it started from
    kl_after: float  # ... with the best step's (<= kl_before)
    best_step: int  # 0: the starting scales stayed best
    steps: int
    tuned: bool  # False: reused from an earlier run
    tune_rows: int
    heldout_rows: int
    settings: dict
    seconds: float

    def record(self) -> dict:
        """What the manifest keeps (settings.end_to_end)."""
        return {**self.settings, "tune_rows": self.tune_rows, "heldout_rows": self.heldout_rows,
                "heldout_kl_before": round(self.kl_before, 6), "heldout_kl_after": round(self.kl_after, 6),
                "best_step": self.best_step, "steps_run": self.steps}


def end_to_end_needs(cfg: ModelConfig, rows: int, cols: int, settings: EndToEndSettings) -> int:
    """Bytes the stage holds at its peak: the model (Engram tables included; the encoded linears' float32
    codes replace their native weights), the native log-probabilities of every row, and one autograd pass
    over `batch_rows` rows: every block's saved tensors (SAVED_PER_BLOCK times its forward peak) and the
    head's logits. The scales act on activations (ScaledCodes): a step builds no weight and no weight-sized
    gradient."""
    blocks = sum(max(block_activations(cfg, layer, settings.batch_rows, cols, DTYPE).values())
                 for layer in range(cfg.num_layers))
    backward = SAVED_PER_BLOCK * blocks + settings.batch_rows * cols * cfg.vocab_size * LOGIT_BYTES
    return model_bytes(cfg, DTYPE) + rows * cols * cfg.vocab_size * 4 + backward


def check_end_to_end_fits(cfg: ModelConfig, rows: int, cols: int, settings: EndToEndSettings,
                          device: str) -> int:
    """The stage's memory, or a refusal saying what it needs against what the device has free."""
    return check_fits(end_to_end_needs(cfg, rows, cols, settings), device,
                      "--tune-e2e holds the whole model and one backward pass",
                      "use --tune (block-wise) alone, or fewer or shorter calibration rows")


def end_to_end(ck: Checkpoint, plan: Plan, quantize_work: Path, work: Path, rows: torch.Tensor,
               settings: EndToEndSettings, job: dict, block_files: tuple[Path, ...] = (), device: str = "cpu",
               say: Callable[[str], None] | None = None) -> EndToEndResult:
    """Tune every EXL3 scale of `plan`'s trunk and head on `rows` (tuning rows, then held-out rows), starting
    from the block-wise stage's `block_files` when given; the result under `work`/tuned."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    cfg = ck.config
    n_tune, n_held = settings.split(rows.shape[0])
    linears = stored_linears(ck, plan, quantize_work, job)
    store = TunedStore(work)
    store.drop_unfinished()
    units = sorted(d for stored in linears.values() for d in stored.digests)
    rows_digest = tokens_digest(rows)
    digest = block_digest(MODEL_FILE, units, settings.record(), rows_digest,
                          ",".join(p.name for p in block_files) or None)
    keys = [k for stored in linears.values() for k in stored.exl3]
    done_record = run_record(settings.record(), rows_digest)
    path = store.path(MODEL_FILE, digest)
    if store.load(MODEL_FILE, digest, keys) is not None:
        info = store.info(path)
        say(f"tune-e2e: reused {path.name}")
        store.mark_finished(STAGE, done_record)
        return EndToEndResult(path, info["kl_before"], info["kl_after"], info["best_step"], info["steps"], False,
                              n_tune, n_held, settings.record(), time.monotonic() - start)
    needs = check_end_to_end_fits(cfg, *rows.shape, settings, device)
    say(f"tune-e2e: {n_tune} tuning + {n_held} held-out rows x {rows.shape[1]} tokens, up to {settings.steps} Adam "
        f"steps of {settings.batch_rows} row(s) over {len(keys)} EXL3 linears; needs about {gib(needs)} GiB on {device}")
    model = DeepseekModel.from_checkpoint(ck, DTYPE, device)
    model.requires_grad_(False)
    rows = rows.to(device)
    tune_rows, held_rows = rows[:n_tune], rows[n_tune:]
    with torch.no_grad():
        native_tune = [torch.log_softmax(model(tune_rows[i:i + 1]), -1) for i in range(n_tune)]
        native_held = [torch.log_softmax(model(held_rows[i:i + 1]), -1) for i in range(n_held)]
    merged = _gather(linears, store.entries(list(block_files)), device)
    drop_native_weights(model, set(merged.sources))
    scales = RelativeScales(merged.exl3)

    def hooks(suh: dict, svh: dict) -> ForwardHooks:
        return scaled_hooks(merged, {k: t.float() for k, t in suh.items()}, {k: t.float() for k, t in svh.items()})

    def held_kl(u16: dict, v16: dict) -> float:
        with torch.no_grad():
            h = hooks(u16, v16)
            return sum(float(_kl(ref, model(held_rows[i:i + 1], h))) for i, ref in enumerate(native_held)) / n_held

    first = scales.stored()
    best = BestHeldOut(held_kl(*first), first, settings.patience)
    step = 0
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.Adam(scales.parameters(), lr=settings.lr)
    bar = tqdm(total=settings.steps, desc="tune-e2e", unit="step", file=sys.stderr, dynamic_ncols=True)
    step_seconds = 0.0  # the Adam steps' own time, held-out measurements left out
    while step < settings.steps:
        step_start = time.monotonic()
        batch = torch.randperm(n_tune, generator=gen)[:settings.batch_rows].tolist()
        opt.zero_grad(set_to_none=True)
        h = hooks(*scales.current())
        loss = sum(_kl(native_tune[i], model(tune_rows[i:i + 1], h)) for i in batch) / len(batch)
        loss.backward()
        opt.step()
        if rows.is_cuda:
            torch.cuda.synchronize()  # the step's kernels are done before its time is read
        step += 1
        step_seconds += time.monotonic() - step_start
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.4f}", best=f"{best.value:.4f}")
        if step == min(2, settings.steps):  # the second step: the first also pays the kernels' warm-up
            per = time.monotonic() - step_start
            say(f"tune-e2e: {per:.3f} s per step; at most {settings.steps} steps = about "
                f"{per * settings.steps / 60:.1f} min plus held-out measurements (early stopping shortens it)")
        if step % settings.eval_every == 0 or step == settings.steps:
            u16, v16 = scales.stored()
            if best.offer(step, held_kl(u16, v16), (u16, v16)):
                break
    bar.close()
    best_u, best_v = best.scales
    info = {"kl_before": best.start, "kl_after": best.value, "best_step": best.step, "steps": step,
            "step_seconds": round(step_seconds, 3), "seconds": round(time.monotonic() - start, 2)}
    store.save(MODEL_FILE, digest, {f"{k}.suh": best_u[k].cpu() for k in keys} | {f"{k}.svh": best_v[k].cpu() for k in keys},
               info)
    store.mark_finished(STAGE, done_record)
    say(f"tune-e2e: held-out KL {best.start:.4g} -> {best.value:.4g} ({best.value / max(best.start, 1e-30):.3f}x) "
        f"after {step} steps (best {best.step}), {time.monotonic() - start:.1f} s")
    return EndToEndResult(path, best.start, best.value, best.step, step, True, n_tune, n_held, settings.record(),
                          time.monotonic() - start)


def _kl(native_log_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(native || model) per token."""
    return (native_log_probs.exp() * (native_log_probs - torch.log_softmax(logits, -1))).sum(-1).mean()


def _gather(linears: dict[str, StoredBlock], start: dict[str, TensorEntry], device: str) -> BlockLinears:
    """Every stored linear of the model as one BlockLinears on `device`, each EXL3 one with the scales tuning
    starts from: the block-wise stage's where `start` has them, else the stored ones."""
    exl3, fixed, sources, joined = {}, {}, {}, {}
    for stored in linears.values():
        lin = stored.load(device)
        for key, f in lin.exl3.items():
            suh, svh = (read_tensor(start[f"{key}.{leaf}"]).to(device) if f"{key}.{leaf}" in start
                        else getattr(f, leaf) for leaf in ("suh", "svh"))
            exl3[key] = ScaledCodes(f.codes, suh, svh)
        fixed.update(lin.fixed)
        sources.update(lin.sources)
        joined.update(lin.joined)
    return BlockLinears(exl3, fixed, sources, joined)
