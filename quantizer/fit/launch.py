"""The launch settings a one-Spark pack carries for native ExLlamaV3's V4.1 loader: `launch.env`, the
environment the recipe's launcher reads (EXL3_ATS_MMAP, EXL3_ATS_COPY), with the cold experts left out of
the copy pattern so that they are served from the mapped file (docs/gb10-memory.md, one Spark).

The copy pattern is a regular expression on tensor names; what matches is copied into GPU memory, the
rest of what can be mapped stays in the page cache. The recipe's own pattern copies everything but the
drafter (`^(?!mtp\\.)`); a cold expert `layers.L.ffn.experts.E` joins the drafter in the negative
lookahead. EXL3_ATS_COPY is documented by the recipe's launcher (one-spark-tp1/scripts/run_tp1.sh) and
not found in the stored loader code (docs/loader-profiles.md, exllamav3-v41). A pack whose drafter stays in
source form launches without it (DRAFT=0, which the launcher also reads): dequantized to FP16 at load the
drafter could not be served from the mapped file, and on one Spark it does not fit beside the trunk.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from quantizer.errors import UserError

LAUNCH_FILE = "launch.env"
DRAFTER_PREFIX = r"mtp\."
_COPY_LINE = re.compile(r"^EXL3_ATS_COPY='([^']*)'$", re.MULTILINE)
_DRAFT_LINE = re.compile(r"^DRAFT=(\d)$", re.MULTILINE)
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)$")


@dataclass(frozen=True)
class Launch:
    """Which experts the engine serves from the mapped file, and what that costs in routing."""

    cold_experts: tuple[str, ...] = ()  # `layers.L.ffn.experts.E`, served from the mapped file
    cold_share: float = 0.0  # share of the calibration's routed tokens that go to them
    drafter: bool = True  # launched with the DSpark drafter (DRAFT=1); off where it stays in source form

    @property
    def copy_pattern(self) -> str:
        """EXL3_ATS_COPY: everything but the drafter and the cold experts is copied into GPU memory."""
        by_layer: dict[int, list[int]] = defaultdict(list)
        for key in self.cold_experts:
            m = _EXPERT.match(key)
            if not m:
                raise ValueError(f"{key}: not a routed expert key (layers.L.ffn.experts.E)")
            by_layer[int(m[1])].append(int(m[2]))
        cold = [rf"layers\.{layer}\.ffn\.experts\.(?:{'|'.join(map(str, sorted(es)))})\."
                for layer, es in sorted(by_layer.items())]
        return f"^(?!{'|'.join([DRAFTER_PREFIX, *cold])})"

    def render(self) -> str:
        cold = (f"{len(self.cold_experts)} cold routed experts ({self.cold_share:.2%} of the calibration's routed "
                "tokens) stay with the drafter in the page cache" if self.cold_experts else
                "every routed expert is copied into GPU memory; the drafter stays in the page cache")
        return "\n".join([
            "# Launch settings for native ExLlamaV3's V4.1 loader (vcruz305/exllamav3 feat/gb10-ats-load) on one Spark,",
            "# written by quantizer. Load them before the recipe's launcher (one-spark-tp1/scripts/run_tp1.sh keeps",
            "# variables already set):  set -a; . ./launch.env; set +a",
            f"# {cold}.",
            *([] if self.drafter else ["# The drafter is in source form (no --overlay drafter): launched without it."]),
            "EXL3_ATS_MMAP=1",
            f"EXL3_ATS_COPY='{self.copy_pattern}'",
            f"DRAFT={int(self.drafter)}",
            "",
        ])


def write_launch(pack: Path, launch: Launch) -> Path:
    path = pack / LAUNCH_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(launch.render())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_launch(pack: str | Path) -> tuple[str, bool] | None:
    """(EXL3_ATS_COPY, whether the drafter runs) of a pack's launch.env, or None when the pack has none."""
    path = Path(pack) / LAUNCH_FILE
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    copy, draft = _COPY_LINE.search(text), _DRAFT_LINE.search(text)
    if not copy or not draft:
        raise UserError(f"{path}: no EXL3_ATS_COPY='...' or DRAFT= line; restore the file from the published pack, "
                        "or rebuild it")
    return copy[1], draft[1] != "0"
