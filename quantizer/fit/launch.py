"""The launch settings a one-Spark pack carries for native ExLlamaV3's V4.1 loader: `launch.env`, the
environment the recipe's launcher reads (docs/gb10-memory.md, one Spark): EXL3_ATS_MMAP and EXL3_ATS_MMAP_MIN
(what the loader may serve from the mapped file), EXL3_ATS_COPY (what it copies all the same), DRAFT, and the
context (CTX) and prefill chunk (CHUNK) the pack was planned for.

The copy pattern is a regular expression on tensor names; what matches is copied into GPU memory, the
rest of what can be mapped stays in the page cache. The recipe's own pattern copies everything but the
drafter (`^(?!mtp\\.)`); a cold expert `layers.L.ffn.experts.E` joins the drafter in the negative
lookahead. EXL3_ATS_COPY is documented by the recipe's launcher (one-spark-tp1/scripts/run_tp1.sh) and
not found in the stored loader code (docs/loader-profiles.md, exllamav3-v41). A pack whose drafter stays in
source form launches without it (DRAFT=0, which the launcher also reads): dequantized to FP16 at load the
drafter could not be served from the mapped file, and on one Spark it does not fit beside the trunk.
run_tp1.sh keeps every variable already set (`export CTX="${CTX:-6144}"`), so loading the file first gives
the pack's context instead of the launcher's 6,144 tokens; CTX must be a multiple of 256 (its README).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from quantizer.errors import UserError

LAUNCH_FILE = "launch.env"
DRAFTER_PREFIX = r"mtp\."
CONTEXT_STEP = 256  # the launcher's CTX is a multiple of this (one-spark-tp1/README.md)
_COPY_LINE = re.compile(r"^EXL3_ATS_COPY='([^']*)'$", re.MULTILINE)
_DRAFT_LINE = re.compile(r"^DRAFT=(\d)$", re.MULTILINE)
_NUMBER_LINE = r"^{}=(\d+)$"
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)$")


@dataclass(frozen=True)
class Launch:
    """Which experts the engine serves from the mapped file, what that costs in routing, and the context,
    prefill chunk and mapping floor the pack is launched with."""

    cold_experts: tuple[str, ...] = ()  # `layers.L.ffn.experts.E`, served from the mapped file
    cold_share: float = 0.0  # share of the calibration's routed tokens that go to them
    drafter: bool = True  # launched with the DSpark drafter (DRAFT=1); off where it stays in source form
    context: int | None = None  # tokens the cache holds (CTX); None: the launcher's default
    chunk: int | None = None  # prefill chunk (CHUNK); None: the launcher's default
    mmap_min: int | None = None  # EXL3_ATS_MMAP_MIN: the smallest tensor served from the mapping

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
        sized = [f"CTX={self.context}"] if self.context else []
        sized += [f"CHUNK={self.chunk}"] if self.chunk else []
        return "\n".join([
            "# Launch settings for native ExLlamaV3's V4.1 loader (vcruz305/exllamav3 feat/gb10-ats-load) on one Spark,",
            "# written by quantizer. Load them before the recipe's launcher (one-spark-tp1/scripts/run_tp1.sh keeps",
            "# variables already set):  set -a; . ./launch.env; set +a",
            f"# {cold}.",
            *([] if self.drafter else ["# The drafter is in source form (no --overlay drafter): launched without it."]),
            *([f"# CTX and CHUNK: the context and prefill chunk the pack was fitted for ({self.context:,} tokens)."]
              if self.context else []),
            "EXL3_ATS_MMAP=1",
            *([f"EXL3_ATS_MMAP_MIN={self.mmap_min}"] if self.mmap_min else []),
            f"EXL3_ATS_COPY='{self.copy_pattern}'",
            f"DRAFT={int(self.drafter)}",
            *sized,
            "",
        ])


def launch_context(tokens: int) -> int:
    """A context the launcher takes: `tokens` rounded down to a multiple of CONTEXT_STEP (at least one step)."""
    return max(CONTEXT_STEP, tokens // CONTEXT_STEP * CONTEXT_STEP)


def write_launch(pack: Path, launch: Launch) -> Path:
    path = pack / LAUNCH_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(launch.render())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class LaunchSettings:
    """What a pack's launch.env tells the engine, as the fit and verify read it."""

    copy_pattern: str
    drafter: bool
    context: int | None = None
    chunk: int | None = None
    mmap_min: int | None = None


def read_launch(pack: str | Path) -> LaunchSettings | None:
    """A pack's launch.env, or None when the pack has none."""
    path = Path(pack) / LAUNCH_FILE
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    copy, draft = _COPY_LINE.search(text), _DRAFT_LINE.search(text)
    if not copy or not draft:
        raise UserError(f"{path}: no EXL3_ATS_COPY='...' or DRAFT= line; restore the file from the published pack, "
                        "or rebuild it")
    number = {name: re.search(_NUMBER_LINE.format(name), text, re.MULTILINE) for name in ("CTX", "CHUNK",
                                                                                           "EXL3_ATS_MMAP_MIN")}
    value = {name: int(m[1]) if m else None for name, m in number.items()}
    return LaunchSettings(copy[1], draft[1] != "0", value["CTX"], value["CHUNK"], value["EXL3_ATS_MMAP_MIN"])
