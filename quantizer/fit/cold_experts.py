"""Cold experts on one Spark: which routed experts an engine that serves weights from the mapped file
leaves in the page cache, so that what it copies into GPU memory fits (docs/gb10-memory.md, one Spark).

The experts calibration routed the fewest tokens to per byte they would free go first, until the worst rank
fits, as long as the experts left out take at most `share` of the routed tokens (a cold expert is read from
NVMe when the page cache has dropped it, so a routed token that reaches one may wait for the disk). With
share 0 every expert is copied: the recipe's own placement.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace

from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.fit.hardware import GIB, Hardware
from quantizer.fit.launch import Launch, launch_context
from quantizer.fit.memory import Scenario, evaluate, mapped_serving
from quantizer.fit.residency import split_mapped
from quantizer.fit.stored import StoredTensor

_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.\d+)\.")
COPY_NOTHING = "(?!)"  # a copy pattern no name matches: every tensor that can be mapped is


def routed_tokens(summary: CalibrationSummary) -> dict[str, float]:
    """Calibration's routed selections per trunk expert (`layers.L.ffn.experts.E` -> tokens)."""
    return {f"layers.{layer.layer}.ffn.experts.{e}": float(n)
            for layer in summary.layers for e, n in enumerate(layer.expert_tokens)}


def check_share(share: float) -> float:
    if not 0 <= share < 1:
        raise UserError(f"--cold-share {share:g}: a share of the routed tokens, at least 0 and below 1")
    return share


def place_cold_experts(cfg: ModelConfig, stored: list[StoredTensor], s: Scenario, hw: Hardware,
                       tokens: dict[str, float], share: float, fill: bool = False, margin_gib: float = 0.0
                       ) -> tuple[Scenario, Launch]:
    """The scenario with the copy pattern that leaves the fewest experts cold within `share` so that it fits
    keeping `margin_gib` free on every rank, and its launch settings (with the scenario's context, the engine's
    prefill chunk and mapping floor); the scenario as it is (every expert copied) when it fits so, when share is
    0, or when the engine maps nothing. With `fill`, every expert the share allows is cold: the most memory the
    share can free, which falls with the bits as the plan grows (what a search for the most bits asks)."""
    serving = mapped_serving(hw, s)
    drafter = s.drafter != "off"
    sized = Launch(drafter=drafter, context=launch_context(s.context), chunk=serving.chunk or None,
                   mmap_min=serving.min_bytes) if serving else Launch(drafter=drafter)
    hot = replace(s, copy_pattern=sized.copy_pattern) if serving else s
    if serving is None or share <= 0 or not tokens:  # no routing known: none cold
        return hot, sized
    short = 0.0 if fill else (margin_gib - min(r.free_gib for r in evaluate(cfg, stored, hot, hw))) * GIB
    if short <= 0 and not fill:
        return hot, sized
    freed = _mappable_bytes(stored, serving, hot)
    total = sum(tokens.values()) or 1.0
    cold, moved, routed = [], 0, 0.0
    for expert in sorted(freed, key=lambda e: (tokens.get(e, 0.0) / freed[e], e)):
        if moved >= short and not fill:
            break
        if (routed + tokens.get(expert, 0.0)) / total > share:
            break
        cold.append(expert)
        moved += freed[expert]
        routed += tokens.get(expert, 0.0)
    launch = replace(sized, cold_experts=tuple(sorted(cold, key=_order)), cold_share=routed / total)
    return replace(s, copy_pattern=launch.copy_pattern), launch


def _mappable_bytes(stored: list[StoredTensor], serving, hot: Scenario) -> dict[str, int]:
    """Bytes each routed expert would move from GPU memory to the page cache if it were cold."""
    _, mapped = split_mapped(stored, serving, COPY_NOTHING, hot.fp8_lazy)
    out: dict[str, int] = defaultdict(int)
    for t in mapped:
        m = _EXPERT.match(t.name)
        if m:
            out[m[1]] += t.nbytes
    return dict(out)


def _order(expert: str) -> tuple[int, int]:
    parts = expert.split(".")
    return int(parts[1]), int(parts[4])
