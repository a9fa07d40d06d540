"""The pack spec: the one place that decides which tensors a pack of a plan stores.

From (model config, plan) it gives every linear the pack holds as its loader sees it (a quantized
wo_a as its o_groups row slices, K 16 as one fused fp16 weight, an aliased cold expert nothing) and
every tensor of the pack with its shape, dtype, bytes and tensor class: the leaves of each encoded
linear (its native `.weight` and `.scale` replaced) and the native tensors passed through byte for
byte. Plan sizes, the fit, the quantize stage, the pack writer and verify all read it, so the layout
is decided once (docs/exl3-format.md, stored tensors; docs/deepseek-v4-layout.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from quantizer.caches import process_cache
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import tensor_nbytes
from quantizer.contract.loader_profiles import ENGRAM_SIBLING, LoaderProfile
from quantizer.contract.stored_linear import StoredLinear
from quantizer.exl3 import UNQUANTIZED, exl3_bytes, leaf_layout
from quantizer.model.targets import classified_layout, stored_parts, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE

if TYPE_CHECKING:
    from quantizer.contract.plan import Plan

EXL3 = "exl3"
NATIVE = "native"
CONVERTED = "converted"  # a plain tensor stored in the dtype its engine reads (profile plain_dtypes)
ENGRAM_DIR = "engram-dir"  # an Engram table kept in the sibling Engram directory, not the pack's
REPLACED_LEAVES = (".weight", ".scale")  # what an encoded linear replaces of its native tensors
ENCODED_PROBE = 4.0  # any EXL3 rate: stored_parts only asks whether a target is encoded


class StoredTensor(NamedTuple):
    """One tensor of a pack (from a spec or read back from a pack's headers)."""

    name: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    cls: str  # tensor class (model/tensor_classes.py)
    storage: str  # EXL3 (a leaf of an EXL3 linear), NATIVE (passed through, or an fp16 weight), CONVERTED
    # (a plain tensor in the dtype the engine reads) or ENGRAM_DIR (an Engram table of the sibling directory)
    K: float | None  # trellis K of the EXL3 linear this leaf belongs to; None for native and fp16
    linear: str | None  # stored key of the encoded linear it belongs to (EXL3 or fp16); None: passed through
    offset: int | None = None  # absolute file offset, read back from a pack's headers; None in a plan's spec


@dataclass(frozen=True)
class PackSpec:
    linears: tuple[StoredLinear, ...]  # every non-aliased target's stored linears, native ones included
    tensors: tuple[StoredTensor, ...]  # the pack's tensors: passed-through natives, then encoded leaves
    replaced: frozenset[str]  # native tensors the pack does not hold (encoded, or served by an alias)

    @property
    def model_dir(self) -> list[StoredTensor]:
        """The tensors of the pack directory itself (Engram tables of a sibling directory left out)."""
        return [t for t in self.tensors if t.storage != ENGRAM_DIR]

    @property
    def encoded(self) -> list[StoredLinear]:
        """The linears the quantize stage writes (EXL3 or fp16), in native layout order."""
        return [s for s in self.linears if s.K is not None]

    def bytes_by_class(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            out[t.cls] += t.nbytes
        return dict(sorted(out.items()))


def stored_linears(cfg: ModelConfig, plan: "Plan") -> list[StoredLinear]:
    """Every linear the pack stores, as its loader sees it, in native layout order: native (K None)
    targets included, aliased cold experts left out. The plan is taken as it is (check_plan checks it)."""
    cold = aliased_keys(plan) if plan.aliases else ()
    parts = _parts(cfg)
    out: list[StoredLinear] = []
    for t in targets(cfg):
        if t.key in cold:
            continue
        k = plan.k[t.key]
        encoded = k is not None and k != UNQUANTIZED
        codebook = plan.codebook if encoded else None
        out += [StoredLinear(key, t, k, codebook, rows) for key, rows in parts[t.key][encoded]]
    return out


def pack_spec(cfg: ModelConfig, plan: "Plan") -> PackSpec:
    """The exact tensors a pack of `plan` holds."""
    linears = stored_linears(cfg, plan)
    replaced = frozenset(t.key + leaf for t in targets(cfg) if plan.k[t.key] is not None for leaf in REPLACED_LEAVES)
    leaves = [StoredTensor(s.key + suffix, nbytes, shape, dtype, s.target.cls, EXL3 if s.K != UNQUANTIZED else NATIVE,
                           s.K if s.K != UNQUANTIZED else None, s.key)
              for s in linears if s.K is not None
              for suffix, shape, dtype, nbytes in leaf_layout(s.in_features, s.out_features, s.K, plan.codebook)]
    profile = plan.profile
    placed = profile.plain_dtypes or profile.engram_tables == ENGRAM_SIBLING  # else every native as it is
    natives = [_placed(n, profile) if placed else n for n in native_tensors(cfg) if n.name not in replaced]
    return PackSpec(tuple(linears), tuple(natives + leaves), frozenset(replaced))


def _placed(n: StoredTensor, profile: LoaderProfile) -> StoredTensor:
    """A passed-through tensor as the loader profile stores it: an Engram table in the sibling directory
    where the engine reads them from there, a plain tensor in the dtype the engine's loader takes."""
    if n.cls == ENGRAM_TABLE and profile.engram_tables == ENGRAM_SIBLING:
        return n._replace(storage=ENGRAM_DIR)
    dtype = profile.plain_dtype(n.name, n.dtype)
    if dtype == n.dtype:
        return n
    return n._replace(dtype=dtype, nbytes=tensor_nbytes(dtype, n.shape), storage=CONVERTED)


def spec_bytes(cfg: ModelConfig, plan: "Plan") -> dict[str, int]:
    """`pack_spec(cfg, plan).bytes_by_class()` without building the tensor list (planning searches
    ask it for many plans of the full model): native bytes, less what encoded targets replace, plus
    their linears' leaves."""
    natives, replaced_bytes = _native_bytes(cfg, plan.profile)
    cold = aliased_keys(plan) if plan.aliases else ()
    parts = _parts(cfg)
    out = defaultdict(int, natives)
    for t in targets(cfg):
        k = plan.k[t.key]
        if k is None:
            continue
        out[t.cls] -= replaced_bytes[t.key]
        if t.key not in cold:
            out[t.cls] += sum(exl3_bytes(t.in_features, rows[1] - rows[0] if rows else t.out_features, k, plan.codebook)
                              for _, rows in parts[t.key][k != UNQUANTIZED])
    return dict(sorted((cls, n) for cls, n in out.items() if n or cls in natives))


def expert_of(key: str) -> str:
    """`layers.3.ffn.experts.5.w1` -> `layers.3.ffn.experts.5` (the unit an alias replaces)."""
    return key.rsplit(".", 1)[0]


def alias_of(plan: "Plan", key: str) -> str | None:
    """The linear that serves an aliased expert's `key` (same projection of the warm expert)."""
    expert = expert_of(key)
    return plan.aliases[expert] + key[len(expert):] if expert in plan.aliases else None


def aliased_keys(plan: "Plan") -> set[str]:
    """Target keys of the aliased cold experts: they store nothing."""
    return {key for key in plan.k if expert_of(key) in plan.aliases}


@process_cache(maxsize=2)
def native_tensors(cfg: ModelConfig) -> tuple[StoredTensor, ...]:
    """Every tensor of the native layout as stored unchanged, built once per model shape (the full
    model has ~96k, and fit searches ask for many plans of one model)."""
    return tuple(StoredTensor(spec.name, spec.nbytes, tuple(spec.shape), spec.dtype, cls, NATIVE, None, None)
                 for spec, cls in classified_layout(cfg))


@process_cache(maxsize=8)
def _native_bytes(cfg: ModelConfig, profile: LoaderProfile) -> tuple[dict[str, int], dict[str, int]]:
    """(native bytes per class as the loader stores them, bytes of each target's `.weight` and `.scale`),
    once per model shape and profile."""
    by_class: dict[str, int] = defaultdict(int)
    by_name = {}
    for n in native_tensors(cfg):
        by_class[n.cls] += _placed(n, profile).nbytes
        by_name[n.name] = n.nbytes
    replaced = {t.key: sum(by_name.get(t.key + leaf, 0) for leaf in REPLACED_LEAVES) for t in targets(cfg)}
    return dict(by_class), replaced


@process_cache(maxsize=2)
def _parts(cfg: ModelConfig) -> dict[str, tuple[list, list]]:
    """Per target key: its stored parts (model/targets.stored_parts) kept whole (index False: native or
    fp16) and encoded (True: a wo_a's slices), once per model shape."""
    return {t.key: (stored_parts(cfg, t, None), stored_parts(cfg, t, ENCODED_PROBE)) for t in targets(cfg)}
