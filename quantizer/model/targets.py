"""Which native tensors become EXL3 linears, and which of those count against the bpw budget.

The EXL3 key of a linear is its native weight name minus `.weight` (`layers.3.ffn.experts.5.w1`),
the name exllamav3 gives the Linear. A target is budgeted when exllamav3's allocator spends `--bits`
on it: the trunk's routed and shared experts, attention with its compressor (`attn.compressor.wkv`
/ `.wgate`), the indexer's query, its compressor (V4) or its key projection `indexer.wk` (V4.1),
and Engram's `wkv` (docs/loader-profiles.md: every Linear exllamav3's DeepSeek-V4 attention block
quantizes).
The head (`head_bits`), the DSpark drafter (`mtp_bits`) and vision sit outside the budget
(docs/exl3-format.md, bits per weight). Everything that is not a target keeps its native storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from quantizer.caches import process_cache
from quantizer.checkpoint.config import ModelConfig
from quantizer.exl3 import HADAMARD_BLOCK, UNQUANTIZED
from quantizer.model.layout import TensorSpec, native_layout
from quantizer.model.tensor_classes import (
    ATTENTION,
    COMPRESSOR,
    DRAFTER,
    ENGRAM_RESIDENT,
    HEAD,
    INDEXER,
    ROUTED_EXPERT,
    SHARED_EXPERT,
    classify,
)

# Target groups: the unit of floors in a uniform plan and of patterns in a recipe.
ROUTED = "routed"
SHARED = "shared"
ATTN = "attention"
INDEX = "indexer"
ENGRAM = "engram"
HEAD_GROUP = "head"
DRAFT = "drafter"
GROUPS = (ROUTED, SHARED, ATTN, INDEX, ENGRAM, HEAD_GROUP, DRAFT)
BUDGETED_GROUPS = (ROUTED, SHARED, ATTN, INDEX, ENGRAM)

ATTENTION_PROJECTIONS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
COMPRESSOR_PROJECTIONS = ("compressor.wkv", "compressor.wgate")  # read the attention input, as wq_a does
INDEXER_PROJECTIONS = ("wq_b", "wk") + COMPRESSOR_PROJECTIONS  # under attn.indexer.
DRAFTER_EXTRA_LINEARS = ("main_proj",)  # markov/confidence heads stay native, as in exllamav3's MTP


@dataclass(frozen=True)
class Target:
    key: str  # EXL3 key: native weight name minus ".weight"
    group: str
    cls: str  # tensor class of the native weight
    layer: int | None  # trunk layer, or drafter block for the drafter group
    expert: int | None
    proj: str  # w1/w2/w3 for experts, wq_a/... for attention, "head", "main_proj", "wkv"
    in_features: int
    out_features: int
    native_bytes: int  # the source's weight + its E8M0 scale grid

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features

    @property
    def budgeted(self) -> bool:
        return self.group in BUDGETED_GROUPS

    @property
    def integer_only(self) -> bool:
        """exllamav3's DSV4 attention modules (indexer query included) set q_half_bits=False."""
        return self.group in (ATTN, INDEX) or (self.group == DRAFT and self.proj in ATTENTION_PROJECTIONS)


FUSED_SLICED = "wo_a"  # exllamav3 stores a quantized grouped wo_a as o_groups row slices


def stored_parts(cfg: ModelConfig, t: Target, k: float | None) -> list[tuple[str, tuple[int, int] | None]]:
    """(stored key, row range of the native [out, in] weight or None for all of it) of each linear a
    pack stores for `t` at K `k`: the o_groups slices `<key>.slice.<g>` of a quantized wo_a
    (exllamav3's DSV4 attention loads it so; K 16 keeps it fused), else the target itself."""
    if t.proj == FUSED_SLICED and k is not None and k != UNQUANTIZED:
        width = t.out_features // cfg.o_groups
        return [(f"{t.key}.slice.{g}", (g * width, (g + 1) * width)) for g in range(cfg.o_groups)]
    return [(t.key, None)]


def weight_features(spec: TensorSpec) -> tuple[int, int]:
    """(in, out) features of a native `[out, in]` weight; MXFP4 bytes hold two inputs each."""
    out, inp = spec.shape
    return (2 * inp if spec.dtype == "I8" else inp), out


def _group(name: str) -> tuple[str, str] | None:
    """(group, projection) of a native weight that EXL3 can hold, or None for native-only tensors."""
    if not name.endswith(".weight"):
        return None
    key = name[: -len(".weight")]
    leaf = key.rsplit(".", 1)[-1]
    c = classify(name)
    if c.cls == ROUTED_EXPERT:
        return ROUTED, c.proj
    if c.cls == SHARED_EXPERT:
        return SHARED, leaf
    if c.cls == ATTENTION and leaf in ATTENTION_PROJECTIONS and key.endswith(f".attn.{leaf}"):
        return ATTN, leaf
    if c.cls == COMPRESSOR and key.split(".attn.", 1)[-1] in COMPRESSOR_PROJECTIONS:
        return ATTN, key.split(".attn.", 1)[-1]
    if c.cls == INDEXER and key.split(".attn.indexer.", 1)[-1] in INDEXER_PROJECTIONS:
        return INDEX, key.split(".attn.indexer.", 1)[-1]
    if c.cls == ENGRAM_RESIDENT and key.endswith(".engram.wkv"):
        return ENGRAM, "wkv"
    if c.cls == HEAD and key == "head":
        return HEAD_GROUP, "head"
    if c.cls == DRAFTER:
        rest = key.split(".", 2)[2]  # drop "mtp.N."
        inner = classify(f"layers.0.{rest}.weight")
        if inner.cls == ROUTED_EXPERT:
            return DRAFT, inner.proj
        if inner.cls == SHARED_EXPERT or rest in DRAFTER_EXTRA_LINEARS:
            return DRAFT, leaf
        if inner.cls == ATTENTION and leaf in ATTENTION_PROJECTIONS and rest == f"attn.{leaf}":
            return DRAFT, leaf
    return None


def _target(spec: TensorSpec, scale_bytes: int) -> Target | None:
    found = _group(spec.name)
    if found is None or len(spec.shape) != 2:
        return None
    inp, out = weight_features(spec)
    if inp % HADAMARD_BLOCK or out % HADAMARD_BLOCK:
        return None
    group, proj = found
    c = classify(spec.name)
    key = spec.name[: -len(".weight")]
    return Target(key, group, c.cls, c.layer, c.expert, proj, inp, out, spec.nbytes + scale_bytes)


def quantizable(cfg: ModelConfig, name: str) -> bool:
    """True when the native weight `name` (e.g. `layers.3.ffn.experts.5.w1.weight`) becomes an EXL3 linear."""
    return name.endswith(".weight") and name[: -len(".weight")] in target_map(cfg)


def targets(cfg: ModelConfig) -> tuple[Target, ...]:
    """Every EXL3 target of the model, in native layout order (computed once per model shape)."""
    return _index(cfg).targets


def target_map(cfg: ModelConfig) -> Mapping[str, Target]:
    """Targets by EXL3 key (read-only)."""
    return _index(cfg).by_key


def classified_layout(cfg: ModelConfig) -> tuple[tuple[TensorSpec, str], ...]:
    """The native layout with each tensor's class, computed once per model shape."""
    return _index(cfg).layout


@dataclass(frozen=True)
class _ModelIndex:
    targets: tuple[Target, ...]
    by_key: Mapping[str, Target]
    layout: tuple[tuple[TensorSpec, str], ...]


@process_cache(maxsize=4)  # the real shape (~1 s to index) outlives the small ones a session also uses
def _index(cfg: ModelConfig) -> _ModelIndex:
    specs = native_layout(cfg)
    scales = {s.name: s.nbytes for s in specs if s.name.endswith(".scale")}
    found = tuple(
        t for t in (_target(s, scales.get(s.name[: -len(".weight")] + ".scale", 0)) for s in specs)
        if t is not None
    )
    layout = tuple((s, classify(s.name).cls) for s in specs)
    return _ModelIndex(found, MappingProxyType({t.key: t for t in found}), layout)
