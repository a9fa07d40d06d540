"""What a pack stores, tensor by tensor, from its safetensors headers or from a plan.

This is fit's input and the pack writer's fit table input: name, bytes, shape, and whether the
tensor belongs to an EXL3 linear (with its K) or keeps a native format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import PAD_PREFIX
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.exl3 import EXL3_LEAVES, k_from_trellis, leaf_layout
from quantizer.model.targets import classified_layout, stored_parts, target_map
from quantizer.plan.plan import Plan, aliased_keys, check_plan

EXL3 = "exl3"
NATIVE = "native"


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    nbytes: int
    shape: tuple[int, ...]
    storage: str  # "exl3" (a leaf of an EXL3 linear) or "native"
    K: float | None  # trellis K of the linear an exl3 leaf belongs to


def exl3_key(name: str) -> tuple[str, str] | None:
    """(key, leaf) if `name` is named like an EXL3 leaf (`layers.3.attn.wq_a.trellis`)."""
    key, _, leaf = name.rpartition(".")
    return (key, leaf) if key and leaf in EXL3_LEAVES else None


def stored_from_pack(pack_dir: str | Path) -> tuple[ModelConfig, list[StoredTensor]]:
    """Read a pack's (or a native checkpoint's) headers: a linear is EXL3 when it stores
    `<key>.trellis` + `.suh` + `.svh`; K = trellis.shape[-1] / 16. Alignment pads are skipped."""
    ck = Checkpoint.open(pack_dir)
    entries = {n: e for n, e in ck.tensors.items() if not n.startswith(PAD_PREFIX)}
    exl3_k: dict[str, float] = {}
    for name, e in entries.items():
        if name.endswith(".trellis"):
            key = name[: -len(".trellis")]
            if f"{key}.suh" not in entries or f"{key}.svh" not in entries:
                raise UserError(f"{e.path}: {name} has no {key}.suh/.svh beside it; the pack is incomplete")
            exl3_k[key] = k_from_trellis(e.shape)
    stored = []
    for name, e in entries.items():
        parsed = exl3_key(name)
        if parsed and parsed[0] in exl3_k:
            stored.append(StoredTensor(name, e.nbytes, tuple(e.shape), EXL3, exl3_k[parsed[0]]))
        else:
            stored.append(StoredTensor(name, e.nbytes, tuple(e.shape), NATIVE, None))
    return ck.config, stored


def stored_from_plan(cfg: ModelConfig, plan: Plan) -> list[StoredTensor]:
    """The tensors a pack of `plan` would hold: EXL3 leaves for quantized targets (their native
    `.scale` grid dropped; none at all for aliased cold experts), native tensors otherwise."""
    check_plan(cfg, plan)
    tmap = target_map(cfg)
    cold = aliased_keys(plan)
    stored = []
    for key, native in _native_tensors(cfg):
        t = tmap.get(key)
        k = plan.k[key] if t is not None else None
        if k is None:
            stored.append(native)
        elif key in cold or not native.name.endswith(".weight"):
            continue
        else:
            for part, rows in stored_parts(cfg, t, k):
                out_features = rows[1] - rows[0] if rows else t.out_features
                for suffix, shape, _, nbytes in leaf_layout(t.in_features, out_features, k, plan.codebook):
                    exl3 = suffix != ".weight"  # K 16 stores a plain fp16 weight
                    stored.append(StoredTensor(part + suffix, nbytes, shape, EXL3 if exl3 else NATIVE,
                                               k if exl3 else None))
    return stored


_NATIVE: dict[str, tuple[tuple[str, StoredTensor], ...]] = {}


def _native_tensors(cfg: ModelConfig) -> tuple[tuple[str, StoredTensor], ...]:
    """(linear key, native StoredTensor) for every tensor of the layout, built once per model shape."""
    shape_key = repr(cfg)
    if shape_key not in _NATIVE:
        _NATIVE.clear()
        _NATIVE[shape_key] = tuple(
            (spec.name.rsplit(".", 1)[0], StoredTensor(spec.name, spec.nbytes, spec.shape, NATIVE, None))
            for spec, _ in classified_layout(cfg)
        )
    return _NATIVE[shape_key]
