"""Tune one block: its EXL3 linears' suh/svh by Adam on the block-output MSE against native targets.

The quantized block is the native block with every encoded linear's weight swapped in through
`ForwardHooks.weight_override` (svh * M * suh, differentiable in the two vectors), so native tensors
(norms, mHC, router, attention sinks) are the source's own and never change. Each scale is trained as a
relative change (suh = suh0 * (1 + a)), which makes one learning rate fit vectors of any magnitude.
Held-out rows are measured with the scales rounded to fp16, as stored, every `eval_every` steps; the best
measurement wins, the untuned scales included, so tuning never leaves a block worse on held-out rows.
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
        hooks = ForwardHooks(weight_override=self._override(weights))
        return self.block(streams, state if advance else fork(state), self.hasher, hooks)

    def weights(self, suh: dict[str, torch.Tensor] | None = None, svh: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        out = dict(self.linears.fixed)
        for key, f in self.linears.exl3.items():
            out[key] = f.weight(None if suh is None else suh[key], None if svh is None else svh[key])
        return out

    def _override(self, weights: dict[str, torch.Tensor]) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
        def override(name: str, _native: torch.Tensor) -> torch.Tensor | None:
            keys = self.linears.sources.get(name)
            if keys is None:
                return None
            return weights[keys[0]] if len(keys) == 1 else torch.cat([weights[k] for k in keys])
        return override


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
    lin = qb.linears.exl3
    base_u = {k: f.suh.float() for k, f in lin.items()}
    base_v = {k: f.svh.float() for k, f in lin.items()}
    rel_u = {k: torch.zeros_like(v, requires_grad=True) for k, v in base_u.items()}
    rel_v = {k: torch.zeros_like(v, requires_grad=True) for k, v in base_v.items()}
    opt = torch.optim.Adam([*rel_u.values(), *rel_v.values()], lr=settings.lr)

    def stored() -> tuple[dict, dict]:
        with torch.no_grad():
            return ({k: (base_u[k] * (1 + rel_u[k])).half() for k in lin},
                    {k: (base_v[k] * (1 + rel_v[k])).half() for k in lin})

    def held_error(u16: dict, v16: dict) -> float:
        return block_error(qb, held, held_targets,
                           qb.weights({k: t.float() for k, t in u16.items()}, {k: t.float() for k, t in v16.items()}))

    best_u, best_v = stored()
    before = best = held_error(best_u, best_v)
    best_step, since_best, step = 0, 0, 0
    gen = torch.Generator().manual_seed(settings.seed)
    steps_start = time.monotonic()  # on_step gets the time of the steps alone
    while step < settings.steps:
        i = int(torch.randint(len(tune), (1,), generator=gen))
        opt.zero_grad(set_to_none=True)
        weights = qb.weights({k: base_u[k] * (1 + rel_u[k]) for k in lin}, {k: base_v[k] * (1 + rel_v[k]) for k in lin})
        loss = (qb.run(tune[i], weights) - tune_targets[i]).square().mean()
        loss.backward()
        opt.step()
        step += 1
        if on_step is not None:
            on_step(step, time.monotonic() - steps_start)
        if step % settings.eval_every == 0 or step == settings.steps:
            u16, v16 = stored()
            err = held_error(u16, v16)
            if err < best:
                best, best_u, best_v, best_step, since_best = err, u16, v16, step, 0
            else:
                since_best += 1
                if since_best >= settings.patience:
                    break
    scales = {f"{k}.suh": best_u[k] for k in lin} | {f"{k}.svh": best_v[k] for k in lin}
    return BlockTuning(scales, before, best, best_step, step, time.monotonic() - start)
