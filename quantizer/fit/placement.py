"""Which rank holds which bytes (docs/gb10-memory.md, tensor parallel).

Replicated on every rank: fused Q-A and KV projections, router, compressor, indexer, norms, mHC,
Engram's q/k weights. Split by columns (output features): attention Q-B (by heads), WO-A (by
group), expert and shared-expert gate/up, head and embedding (by vocab). Split by rows (input
features): WO-B, expert and shared-expert down, Engram wkv (by hash heads). An EXL3 linear rotates
128-wide Hadamard blocks, so its split lands on a 128-feature block edge and ranks can differ by a
block: 2304 = 18 blocks -> TP4 640/640/512/512, the first ranks wide; a source-form (FP8 / MXFP4 / BF16)
linear splits evenly (its scale blocks are 32 wide: 2304/4 = 576). Routed experts split the same way
under `tp`, or stay whole under `ep` (E/ranks experts each). What differs by engine is its
`TensorParallel` (configs/hardware/gb10.json): vLLM replicates Engram's wkv and runs the vision encoder
on every rank; TensorFold keeps the embedding whole on every rank and serves four Sparks as two TP2
pairs, with the routed experts balanced across the four and the drafter split inside each pair.
Engram tables stay on NVMe (`nvme`), keep their scale rows resident (`scales`), or are resident
(`resident`), split across ranks by hash heads. Vision runs on rank 0, on every rank, or is off; the
DSpark drafter is split like the trunk, held whole by rank 0, or off.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, replace
from itertools import accumulate

from quantizer.caches import process_cache
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import is_engram_table
from quantizer.contract.pack_spec import native_tensors
from quantizer.exl3 import HADAMARD_BLOCK
from quantizer.fit.hardware import PAIRS, REPLICATED, TensorParallel
from quantizer.fit.stored import EXL3, StoredTensor, exl3_key
from quantizer.model.targets import target_map
from quantizer.model.tensor_classes import (
    ATTENTION,
    DRAFTER,
    ENGRAM_RESIDENT,
    ENGRAM_TABLE,
    HEAD,
    ROUTED_EXPERT,
    SHARED_EXPERT,
    VISION,
    classify,
)

SPLITS = ("tp", "ep")
ENGRAM_MODES = ("nvme", "scales", "resident")
DRAFTER_MODES = ("split", "rank0", "off")
VISION_MODES = ("rank0", "all", "off")

IN, OUT = "in", "out"
# projection -> the feature axis its tensor-parallel split cuts
_AXIS = {
    ROUTED_EXPERT: {"w1": OUT, "w3": OUT, "w2": IN},
    SHARED_EXPERT: {"w1": OUT, "w3": OUT, "w2": IN},
    ATTENTION: {"wq_b": OUT, "wo_a": OUT, "wo_b": IN},
    ENGRAM_RESIDENT: {"wkv": IN},
    HEAD: {"head": OUT},  # by vocab
}
# leaves of a linear that span each axis (suh is per input, svh/bias per output)
_SPANS = {IN: {"trellis", "suh", "weight", "scale"}, OUT: {"trellis", "svh", "bias", "weight", "scale"}}
_MTP_PREFIX = re.compile(r"^mtp\.\d+\.")
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")
_WO_A_SLICE = re.compile(r"\.wo_a\.slice\.(\d+)$")  # exllamav3 stores a quantized wo_a as o_groups slices
# the drafter's vocab-sized tables (V4.1 embed/head, V4 markov_w1/w2), split by vocab like embed
_VOCAB_ROWS = (".markov_head.embed", ".markov_head.head", ".markov_head.markov_w1", ".markov_head.markov_w2")


@dataclass(frozen=True)
class Options:
    sparks: int
    split: str = "tp"
    engram: str = "nvme"
    drafter: str = "split"
    vision: str = "rank0"
    tp: TensorParallel = TensorParallel()  # the engine's own split rules


def distribute(units: int, ranks: int) -> list[int]:
    """`units` dealt to ranks, the first ranks taking one more when they do not divide evenly."""
    base, extra = divmod(units, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def block_split(features: int, ranks: int) -> list[int]:
    """Features per rank when a dimension is cut on 128-wide blocks (2304/4 -> 640,640,512,512);
    a ragged last block comes off the last ranks."""
    sizes = [b * HADAMARD_BLOCK for b in distribute(-(-features // HADAMARD_BLOCK), ranks)]
    excess = sum(sizes) - features
    for r in reversed(range(ranks)):
        cut = min(excess, sizes[r])
        sizes[r] -= cut
        excess -= cut
    return sizes


def _shares(nbytes: int, parts: list[int]) -> list[int]:
    """nbytes spread in proportion to parts; rounding left on the first rank keeps the total exact."""
    total = sum(parts)
    out = [nbytes * p // total for p in parts]
    out[0] += nbytes - sum(out)
    return out


class Placer:
    """Per-rank bytes of stored tensors under one topology and set of options."""

    def __init__(self, cfg: ModelConfig, options: Options):
        self.cfg, self.o, self.ranks = cfg, options, options.sparks
        self.targets = target_map(cfg)
        hash_heads = max(1, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads)
        self.head_parts = distribute(hash_heads, self.ranks)
        self._axis_cache: dict[tuple[int, int], list[int]] = {}
        self.pairs = options.tp.four_ranks == PAIRS and self.ranks == 4
        self.pair_placer = Placer(cfg, replace(options, sparks=2)) if self.pairs else None

    def _split(self, nbytes: int, features: int) -> list[int]:
        key = (features, self.ranks)
        if key not in self._axis_cache:
            self._axis_cache[key] = block_split(features, self.ranks)
        return _shares(nbytes, self._axis_cache[key])

    def _whole(self, nbytes: int, rank: int) -> list[int]:
        out = [0] * self.ranks
        out[rank] = nbytes
        return out

    def place(self, t: StoredTensor) -> tuple[str, list[int]]:
        """(tensor class, bytes on each rank) of one stored tensor."""
        c = classify(t.name)
        if c.cls == ENGRAM_TABLE:
            keep = self.o.engram == "resident" or (self.o.engram == "scales" and t.name.endswith(".scale"))
            return c.cls, _shares(t.nbytes, self.head_parts) if keep else [0] * self.ranks
        if c.cls == VISION:
            if self.o.vision == "off":
                return c.cls, [0] * self.ranks
            return c.cls, [t.nbytes] * self.ranks if self.o.vision == "all" else self._whole(t.nbytes, 0)
        if c.cls == DRAFTER:
            if self.o.drafter == "off":
                return c.cls, [0] * self.ranks
            if self.o.drafter == "rank0":
                return c.cls, self._whole(t.nbytes, 0)
            if self.pairs:  # each TP2 pair holds its own copy of the drafter, split inside the pair
                half = self.pair_placer.place(t)[1]
                return c.cls, half + half
            inner = classify(_MTP_PREFIX.sub("layers.0.", t.name, count=1))
            return c.cls, self._tp(t, inner.cls, inner.expert, self.cfg.experts_in("mtp"))
        return c.cls, self._tp(t, c.cls, c.expert, self.cfg.n_routed_experts)

    def _tp(self, t: StoredTensor, cls: str, expert: int | None, experts: int) -> list[int]:
        if self.ranks == 1:
            return [t.nbytes]
        if cls == ROUTED_EXPERT and self.o.split == "ep":
            edges = list(accumulate(distribute(experts, self.ranks)))
            return self._whole(t.nbytes, bisect_right(edges, expert))
        if cls == ROUTED_EXPERT and self.pairs and t.name.startswith("layers."):
            return _shares(t.nbytes, [1] * self.ranks)  # the pairs' balanced experts
        parsed = exl3_key(t.name) if t.storage == EXL3 else None
        key, leaf = parsed if parsed else t.name.rpartition(".")[::2]
        group = _WO_A_SLICE.search(key)
        if group:  # a whole wo_a slice per group, the groups split across ranks like the heads
            edges = list(accumulate(distribute(self.cfg.o_groups, self.ranks)))
            return self._whole(t.nbytes, bisect_right(edges, int(group[1])))
        if key == "embed" or key.endswith(_VOCAB_ROWS):  # native [vocab, dim] tables
            return [t.nbytes] * self.ranks if self.o.tp.embed == REPLICATED else self._even(t.nbytes)
        if cls == ENGRAM_RESIDENT and self.o.tp.engram_wkv == REPLICATED:
            return [t.nbytes] * self.ranks
        axis = _AXIS.get(cls, {}).get(key.rsplit(".", 1)[-1])
        target = self.targets.get(key)
        if axis is None or target is None or leaf not in _SPANS[axis]:
            return [t.nbytes] * self.ranks  # replicated
        if t.storage != EXL3:
            return self._even(t.nbytes)
        return self._split(t.nbytes, target.in_features if axis == IN else target.out_features)

    def _even(self, nbytes: int) -> list[int]:
        """A source-form tensor split evenly (its 32-wide scale blocks divide every split here)."""
        return _shares(nbytes, [1] * self.ranks)


def with_engram_tables(cfg: ModelConfig, stored: list[StoredTensor], engram: str) -> list[StoredTensor]:
    """Packs usually leave the Engram tables in the source's own shards (47/48); when they are to be
    resident (or their scale rows are), count them from the model's native layout."""
    if engram == "nvme" or not cfg.engram_layer_ids or any(is_engram_table(t.name) for t in stored):
        return stored
    tables = [t for t in native_tensors(cfg) if t.cls == ENGRAM_TABLE]
    return [*stored, *tables]


@dataclass
class RankWeights:
    """Resident weight bytes per rank, by tensor class."""

    by_class: list[dict[str, int]]

    @property
    def totals(self) -> list[int]:
        return [sum(d.values()) for d in self.by_class]


@process_cache(maxsize=1 << 18)  # the real model stores about 176K tensors; a fit probes a dozen plans of them
def _name_kind(name: str) -> tuple[str, str | None, str | None]:
    """A stored name with its layer and expert numbers as `#`, its expert number, and its wo_a slice's group
    (which decides its rank)."""
    expert = _EXPERT_NUMBER.search(name)
    group = _WO_A_SLICE.search(name.rpartition(".")[0])
    return _NUMBER.sub("#", name), expert[1] if expert else None, group[1] if group else None


def rank_weights(cfg: ModelConfig, stored: list[StoredTensor], options: Options) -> RankWeights:
    """Sum placed bytes per rank and class. Tensors that differ only in layer/expert numbers place
    alike (same shape, same rule), so each kind is placed once and counted; under `ep` the expert
    number decides the rank and stays in the kind, as a wo_a slice's group number always does."""
    stored = with_engram_tables(cfg, stored, options.engram)
    ep = options.split == "ep" and options.sparks > 1
    kinds: dict[tuple, int] = defaultdict(int)
    examples: dict[tuple, StoredTensor] = {}
    for t in stored:
        pattern, expert, group = _name_kind(t.name)
        kind = (pattern, t.nbytes, t.storage, expert if ep else None, group)
        kinds[kind] += 1
        if kind not in examples:
            examples[kind] = t
    placer = Placer(cfg, options)
    by_class: list[dict[str, int]] = [defaultdict(int) for _ in range(options.sparks)]
    for kind, count in kinds.items():
        cls, per_rank = placer.place(examples[kind])
        for r, n in enumerate(per_rank):
            if n:
                by_class[r][cls] += n * count
    return RankWeights([dict(d) for d in by_class])
