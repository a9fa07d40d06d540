"""Tune one block: its EXL3 linears' suh/svh by Adam on the block-output MSE against native targets.

The quantized block is the native block with every encoded linear applied as its codes and scales through
`ForwardHooks.scaled_codes` (svh * linear(x * suh, M), differentiable in the two vectors), so native tensors
(norms, mHC, router, attention sinks) are the source's own and never change. Scales move as relative
changes and the best held-out measurement (every `eval_every` steps, fp16 scales) wins, the untuned
scales included (scales.py), so tuning never leaves a block worse on held-out rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from quantizer.model.block import Block
from quantizer.model.hooks import ForwardHooks, ScaledCodes
from quantizer.model.state import ForwardState
from quantizer.tune.scales import BestHeldOut, RelativeScales
from quantizer.tune.settings import TuneSettings

Batch = tuple[torch.Tensor, ForwardState]  # hc streams entering the block, and the state they carry


@dataclass(frozen=True)
class BlockLinears:
    """The block's stored linears by stored key, as fixed codes and stored scales: `exl3` the trainable
    ones, `fixed` the fp16 ones (K 16: the weight itself with unit scales, never trained). `sources` gives
    per native weight name the stored keys it is made of (wo_a: its row slices), and `joined` the codes of
    a name made of several keys as one tensor (the keys' codes are views of it)."""

    exl3: dict[str, ScaledCodes]
    fixed: dict[str, ScaledCodes]
    sources: dict[str, list[str]]
    joined: dict[str, torch.Tensor]


def join_linears(exl3: dict[str, ScaledCodes], fixed: dict[str, ScaledCodes], sources: dict[str, list[str]]
                 ) -> BlockLinears:
    """A block's linears, each name of several keys (wo_a's slices) with their codes joined in one tensor
    and each key's codes a view of it, so the grouped product reads them in place."""
    exl3, fixed, joined = dict(exl3), dict(fixed), {}
    for name, keys in sources.items():
        if len(keys) > 1 and name not in joined:
            parts = [exl3[k] if k in exl3 else fixed[k] for k in keys]
            joined[name] = torch.cat([p.codes for p in parts])
            rows = 0
            for k, p in zip(keys, parts):
                view = ScaledCodes(joined[name][rows:rows + p.codes.shape[0]], p.suh, p.svh)
                rows += p.codes.shape[0]
                (exl3 if k in exl3 else fixed)[k] = view
    return BlockLinears(exl3, fixed, sources, joined)


@dataclass(frozen=True)
class BlockTuning:
    scales: dict[str, torch.Tensor]  # `<key>.suh` / `<key>.svh` -> fp16, the best held-out step's
    error_before: float  # held-out block-output MSE with the stored scales
    error_after: float  # ... with the tuned scales (<= error_before)
    best_step: int  # 0: the stored scales stayed best
    steps: int  # Adam steps run
    seconds: float
    held_seconds: float  # of `seconds`, the held-out measurements'


def fork(state: ForwardState) -> ForwardState:
    """A copy a block may advance without touching `state` (its tensors are replaced, never written)."""
    return replace(state, compressed=dict(state.compressed), selections=dict(state.selections))


class QuantizedBlock:
    """A native block run with the EXL3 linears of `linears` at given scales."""

    def __init__(self, block: Block, linears: BlockLinears, hasher):
        self.block, self.linears, self.hasher = block, linears, hasher

    def run(self, batch: Batch, hooks: ForwardHooks, advance: bool = False) -> torch.Tensor:
        streams, state = batch
        return self.block(streams, state if advance else fork(state), self.hasher, hooks)

    def hooks(self, suh: dict[str, torch.Tensor] | None = None, svh: dict[str, torch.Tensor] | None = None
              ) -> ForwardHooks:
        return scaled_hooks(self.linears, suh, svh)


def scaled_hooks(linears: BlockLinears, suh: dict[str, torch.Tensor] | None = None,
                 svh: dict[str, torch.Tensor] | None = None) -> ForwardHooks:
    """Hooks that apply each native weight as its stored linears' codes, the EXL3 ones at these scales
    (float32 by stored key; default: the stored ones), so no step builds a weight (ScaledCodes)."""
    def scales(key: str, given: dict[str, torch.Tensor] | None, leaf: str) -> torch.Tensor:
        if given is not None and key in given:
            return given[key]
        return getattr(linears.exl3[key] if key in linears.exl3 else linears.fixed[key], leaf).float()

    def scaled(name: str) -> ScaledCodes | None:
        keys = linears.sources.get(name)
        if keys is None:
            return None
        suhs, svhs = [scales(k, suh, "suh") for k in keys], [scales(k, svh, "svh") for k in keys]
        if len(keys) == 1:
            stored = linears.exl3[keys[0]] if keys[0] in linears.exl3 else linears.fixed[keys[0]]
            return ScaledCodes(stored.codes, suhs[0], svhs[0])
        return ScaledCodes(linears.joined[name], torch.stack(suhs), torch.cat(svhs))
    return ForwardHooks(scaled_codes=scaled)


def block_error(qb: QuantizedBlock, batches: list[Batch], targets: list[torch.Tensor], hooks: ForwardHooks) -> float:
    """Mean squared error of the block's output streams against the targets over these batches."""
    with torch.no_grad():
        total = sum(float((qb.run(b, hooks) - t).square().sum()) for b, t in zip(batches, targets))
    return total / sum(t.numel() for t in targets)


def tune_block(qb: QuantizedBlock, tune: list[Batch], tune_targets: list[torch.Tensor], held: list[Batch],
               held_targets: list[torch.Tensor], settings: TuneSettings,
               on_step: Callable[[int, float], None] | None = None) -> BlockTuning:
    start = time.monotonic()
    scales = RelativeScales(qb.linears.exl3)
    opt = torch.optim.Adam(scales.parameters(), lr=settings.lr)

    held_s = 0.0

    def held_error(u16: dict, v16: dict) -> float:
        nonlocal held_s
        t0 = time.monotonic()
        error = block_error(qb, held, held_targets,
                            qb.hooks({k: t.float() for k, t in u16.items()}, {k: t.float() for k, t in v16.items()}))
        held_s += time.monotonic() - t0
        return error

    first = scales.stored()
    best = BestHeldOut(held_error(*first), first, settings.patience)
    step = 0
    gen = torch.Generator().manual_seed(settings.seed)
    steps_start = time.monotonic()  # on_step gets the time of the steps alone
    while step < settings.steps:
        i = int(torch.randint(len(tune), (1,), generator=gen))
        opt.zero_grad(set_to_none=True)
        loss = (qb.run(tune[i], qb.hooks(*scales.current())) - tune_targets[i]).square().mean()
        loss.backward()
        opt.step()
        step += 1
        if on_step is not None:
            on_step(step, time.monotonic() - steps_start)
        if step % settings.eval_every == 0 or step == settings.steps:
            u16, v16 = scales.stored()
            if best.offer(step, held_error(u16, v16), (u16, v16)):
                break
    best_u, best_v = best.scales
    tuned = {f"{k}.suh": best_u[k] for k in scales.keys} | {f"{k}.svh": best_v[k] for k in scales.keys}
    return BlockTuning(tuned, best.start, best.value, best.step, step, time.monotonic() - start, held_s)
