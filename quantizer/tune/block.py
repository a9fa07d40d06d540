"""Tune one block: its EXL3 linears' suh/svh by Adam on the block-output MSE against native targets.

The quantized block is the native block with every encoded linear's weight swapped in through
`ForwardHooks.weight_override` (svh * M * suh, differentiable in the two vectors), so native tensors
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
from quantizer.model.hooks import ForwardHooks
from quantizer.model.state import ForwardState
from quantizer.tune.factor import FactoredLinear
from quantizer.tune.scales import BestHeldOut, RelativeScales
from quantizer.tune.settings import TuneSettings

Batch = tuple[torch.Tensor, ForwardState]  # hc streams entering the block, and the state they carry


@dataclass(frozen=True)
class BlockLinears:
    """The block's stored linears: trainable EXL3 ones by stored key, fixed fp16 ones (K 16) by stored
    key, and per native weight name the stored keys whose weights it is made of (wo_a: its slices)."""

    exl3: dict[str, FactoredLinear]
    fixed: dict[str, torch.Tensor]
    sources: dict[str, list[str]]


@dataclass(frozen=True)
class BlockTuning:
    scales: dict[str, torch.Tensor]  # `<key>.suh` / `<key>.svh` -> fp16, the best held-out step's
    error_before: float  # held-out block-output MSE with the stored scales
    error_after: float  # ... with the tuned scales (<= error_before)
    best_step: int  # 0: the stored scales stayed best
    steps: int  # Adam steps run
    seconds: float


def fork(state: ForwardState) -> ForwardState:
    """A copy a block may advance without touching `state` (its tensors are replaced, never written)."""
    return replace(state, compressed=dict(state.compressed), selections=dict(state.selections))


class QuantizedBlock:
    """A native block run with the EXL3 weights of `linears` at given scales."""

    def __init__(self, block: Block, linears: BlockLinears, hasher):
        self.block, self.linears, self.hasher = block, linears, hasher

    def run(self, batch: Batch, weights: dict[str, torch.Tensor], advance: bool = False) -> torch.Tensor:
        streams, state = batch
        return self.block(streams, state if advance else fork(state), self.hasher, override_hooks(self.linears, weights))

    def weights(self, suh: dict[str, torch.Tensor] | None = None, svh: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        return linear_weights(self.linears, suh, svh)


def linear_weights(linears: BlockLinears, suh: dict[str, torch.Tensor] | None = None,
                   svh: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every stored linear's weight by stored key: EXL3 ones at these scales (default: the stored ones)."""
    out = dict(linears.fixed)
    for key, f in linears.exl3.items():
        out[key] = f.weight(None if suh is None else suh[key], None if svh is None else svh[key])
    return out


def override_hooks(linears: BlockLinears, weights: dict[str, torch.Tensor]) -> ForwardHooks:
    """Hooks that give each native weight the stored linears' `weights` it is made of (wo_a: its slices)."""
    def override(name: str, _native: torch.Tensor) -> torch.Tensor | None:
        keys = linears.sources.get(name)
        if keys is None:
            return None
        return weights[keys[0]] if len(keys) == 1 else torch.cat([weights[k] for k in keys])
    return ForwardHooks(weight_override=override)


def block_error(qb: QuantizedBlock, batches: list[Batch], targets: list[torch.Tensor],
                weights: dict[str, torch.Tensor]) -> float:
    """Mean squared error of the block's output streams against the targets over these batches."""
    with torch.no_grad():
        total = sum(float((qb.run(b, weights) - t).square().sum()) for b, t in zip(batches, targets))
    return total / sum(t.numel() for t in targets)


def tune_block(qb: QuantizedBlock, tune: list[Batch], tune_targets: list[torch.Tensor], held: list[Batch],
               held_targets: list[torch.Tensor], settings: TuneSettings,
               on_step: Callable[[int, float], None] | None = None) -> BlockTuning:
    start = time.monotonic()
    scales = RelativeScales(qb.linears.exl3)
    opt = torch.optim.Adam(scales.parameters(), lr=settings.lr)

    def held_error(u16: dict, v16: dict) -> float:
        return block_error(qb, held, held_targets,
                           qb.weights({k: t.float() for k, t in u16.items()}, {k: t.float() for k, t in v16.items()}))

    first = scales.stored()
    best = BestHeldOut(held_error(*first), first, settings.patience)
    step = 0
    gen = torch.Generator().manual_seed(settings.seed)
    steps_start = time.monotonic()  # on_step gets the time of the steps alone
    while step < settings.steps:
        i = int(torch.randint(len(tune), (1,), generator=gen))
        opt.zero_grad(set_to_none=True)
        loss = (qb.run(tune[i], qb.weights(*scales.current())) - tune_targets[i]).square().mean()
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
    return BlockTuning(tuned, best.start, best.value, best.step, step, time.monotonic() - start)
