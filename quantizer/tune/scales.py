"""What both tune stages train and keep: each EXL3 scale as a relative change, and the best held-out step.

A scale is trained as suh = suh0 * (1 + a) (and svh alike), which makes one learning rate fit vectors of
any magnitude; what is measured and kept is the scale rounded to fp16, as the pack stores it. The best
held-out measurement wins, the starting scales' included, so tuning never leaves the held-out error
higher than it found it; `patience` measurements without progress stop a run.
"""

from __future__ import annotations

import torch

from quantizer.model.hooks import ScaledCodes


class RelativeScales:
    def __init__(self, exl3: dict[str, ScaledCodes]):
        self.keys = list(exl3)
        self.base_u = {k: f.suh.float() for k, f in exl3.items()}
        self.base_v = {k: f.svh.float() for k, f in exl3.items()}
        self.rel_u = {k: torch.zeros_like(v, requires_grad=True) for k, v in self.base_u.items()}
        self.rel_v = {k: torch.zeros_like(v, requires_grad=True) for k, v in self.base_v.items()}

    def parameters(self) -> list[torch.Tensor]:
        return [*self.rel_u.values(), *self.rel_v.values()]

    def current(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(suh, svh) by key, float32, differentiable in the relative changes."""
        return ({k: self.base_u[k] * (1 + self.rel_u[k]) for k in self.keys},
                {k: self.base_v[k] * (1 + self.rel_v[k]) for k in self.keys})

    def stored(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The current scales as the pack stores them (fp16)."""
        with torch.no_grad():
            u, v = self.current()
            return {k: t.half() for k, t in u.items()}, {k: t.half() for k, t in v.items()}


class BestHeldOut:
    """The lowest held-out measurement so far, the fp16 scales that gave it and their step."""

    def __init__(self, value: float, scales: tuple[dict, dict], patience: int):
        self.start = self.value = value
        self.scales, self.step, self.patience, self._since = scales, 0, patience, 0

    def offer(self, step: int, value: float, scales: tuple[dict, dict]) -> bool:
        """Keep this measurement if it is the best; True once `patience` in a row were not."""
        if value < self.value:
            self.value, self.scales, self.step, self._since = value, scales, step, 0
            return False
        self._since += 1
        return self._since >= self.patience
