"""From plan targets to the linears exllamav3 stores, and the work units that encode them.

A plan gives K per EXL3 key (the native weight name minus `.weight`). exllamav3's DSV4 attention
loads the fused `wo_a` as `o_groups` row slices, each its own Linear (`<key>.slice.<g>`, rows
g*o_lora_rank .. (g+1)*o_lora_rank of the fused weight, qmap `<attn>.o.<g>`), so a quantized `wo_a`
is stored as those slices; every other target is stored under its own key. K 16 keeps a linear as an
unquantized fp16 `<key>.weight` (fused, as exllamav3 reads `wo_a.weight` and slices it itself).

On CPU each stored linear is its own unit; on CUDA same-shape linears go through exllamav3's batch
encoder together: the routed (or drafter) experts of one layer and projection per K, and the wo_a
slices of one layer, in chunks that bound the fp32 weights held on the GPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from quantizer.checkpoint.config import ModelConfig
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.targets import DRAFT, ROUTED, Target, stored_parts, targets
from quantizer.plan.plan import Plan, aliased_keys
from quantizer.quantize.results import Unit

GPU_BATCH_BYTES = 4 << 30  # fp32 weights of one batched unit on the GPU


@dataclass(frozen=True)
class StoredLinear:
    """One linear as exllamav3 stores it, and where its weight comes from in the source."""

    key: str  # stored key: the target key, or `<wo_a key>.slice.<g>`
    target: Target
    K: float
    rows: tuple[int, int] | None  # row range of the native [out, in] weight; None = all of it

    @property
    def in_features(self) -> int:
        return self.target.in_features

    @property
    def out_features(self) -> int:
        return self.rows[1] - self.rows[0] if self.rows else self.target.out_features

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


def stored_linears(cfg: ModelConfig, plan: Plan) -> list[StoredLinear]:
    """Every linear the pack stores as EXL3 (or fp16, K 16), in native layout order; aliased experts
    and native (K None) targets store none."""
    cold = aliased_keys(plan)
    out: list[StoredLinear] = []
    for t in targets(cfg):
        k = plan.k[t.key]
        if k is None or t.key in cold:
            continue
        out += [StoredLinear(key, t, k, rows) for key, rows in stored_parts(cfg, t, k)]
    return out


def tensor_seed(job_seed: int, key: str) -> int:
    """A per-linear seed from the job seed and the stored key alone, so any subset of linears
    encodes identically whatever ran before it."""
    digest = hashlib.sha256(f"{job_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def work_units(linears: list[StoredLinear], device: str) -> list[Unit]:
    """Units in stream order (layer by layer); a batch sits where its first member was."""
    slots: dict[tuple, list[StoredLinear]] = {}
    for s in linears:
        slots.setdefault(_batch_slot(s) if device == "cuda" else ("one", s.key), []).append(s)
    out: list[Unit] = []
    for slot, members in slots.items():
        if slot[0] == "one":
            out.append(Unit(members[0].key, (members[0].key,), members[0].K, members[0].numel))
            continue
        _, stem, proj, k = slot
        per_batch = max(1, GPU_BATCH_BYTES // (4 * members[0].numel))
        for i in range(0, len(members), per_batch):
            chunk = members[i : i + per_batch]
            name = f"{stem}.{proj}.K{k:g}.batch{i // per_batch}"
            out.append(Unit(name, tuple(s.key for s in chunk), k, sum(s.numel for s in chunk)))
    return out


def _batch_slot(s: StoredLinear) -> tuple:
    """Same-shape experts of one layer and projection at one K share a slot, and so do the wo_a slices
    of one layer (each with its own Hessian); K 16 is only cast."""
    t = s.target
    if s.K == UNQUANTIZED:
        return ("one", s.key)
    if t.group in (ROUTED, DRAFT) and t.expert is not None:
        return ("batch", t.key.rsplit(".", 2)[0], t.proj, s.K)
    if s.rows is not None:  # a wo_a slice
        return ("batch", t.key.rsplit(".", 1)[0], t.proj, s.K)
    return ("one", s.key)
