"""What each native tensor is: its class, and for routed experts the layer, expert and projection.

Classes decide everything downstream (what is quantized, at what floor, what is split across
Sparks, what lives on NVMe), so they are defined once, here. A `.scale` grid belongs to its weight,
and so do the leaves an EXL3 linear stores in its place (`.trellis`, `.suh`, `.svh`, the `.mul1` /
`.mcg` codebook marker, `.bias`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantizer.checkpoint.source import is_engram_table

ROUTED_EXPERT = "routed_expert"
SHARED_EXPERT = "shared_expert"
ATTENTION = "attention"
COMPRESSOR = "compressor"
INDEXER = "indexer"
ROUTER = "router"
MHC = "mhc"
NORM = "norm"
EMBED = "embed"
HEAD = "head"
ENGRAM_TABLE = "engram_table"
ENGRAM_RESIDENT = "engram_resident"
DRAFTER = "dspark_drafter"
VISION = "vision"
OTHER = "other"

CLASSES = (
    ROUTED_EXPERT, SHARED_EXPERT, ATTENTION, COMPRESSOR, INDEXER, ROUTER, MHC, NORM, EMBED, HEAD,
    ENGRAM_TABLE, ENGRAM_RESIDENT, DRAFTER, VISION, OTHER,
)


@dataclass(frozen=True)
class TensorClass:
    cls: str
    layer: int | None = None  # trunk layer, or drafter block for DSpark tensors
    expert: int | None = None
    proj: str | None = None  # w1 (gate), w2 (down), w3 (up) for experts


_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale|trellis|suh|svh|mul1|mcg|bias)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.")
_MTP_EXPERT = re.compile(r"^mtp\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.")

_IN_LAYER = (
    (re.compile(r"^attn\.compressor\."), COMPRESSOR),
    (re.compile(r"^attn\.indexer\."), INDEXER),
    (re.compile(r"^attn\."), ATTENTION),
    (re.compile(r"^ffn\.shared_experts\."), SHARED_EXPERT),
    (re.compile(r"^ffn\.gate\."), ROUTER),
    (re.compile(r"^hc_"), MHC),
    (re.compile(r"^(attn|ffn)_norm\."), NORM),
    (re.compile(r"^engram\."), ENGRAM_RESIDENT),
)


def classify(name: str) -> TensorClass:
    m = _EXPERT.match(name)
    if m:
        return TensorClass(ROUTED_EXPERT, int(m[1]), int(m[2]), m[3])
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m[1]), m[2]
        if is_engram_table(name):
            return TensorClass(ENGRAM_TABLE, layer)
        for pattern, cls in _IN_LAYER:
            if pattern.match(rest):
                return TensorClass(cls, layer)
        return TensorClass(OTHER, layer)
    m = _MTP_EXPERT.match(name)
    if m:
        return TensorClass(DRAFTER, int(m[1]), int(m[2]), m[3])
    m = _MTP.match(name)
    if m:
        return TensorClass(DRAFTER, int(m[1]))
    if name.startswith(("vision.", "aligner.", "image_")):
        return TensorClass(VISION)
    if name == "embed.weight":
        return TensorClass(EMBED)
    if name == "norm.weight" or name.startswith("head."):
        return TensorClass(HEAD)
    if name.startswith("hc_head_"):
        return TensorClass(MHC)
    return TensorClass(OTHER)
