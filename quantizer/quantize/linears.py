"""The work units that encode a plan's stored linears (the pack spec's `encoded`, contract/pack_spec.py),
and the per-linear seeds.

On CPU each stored linear is its own unit; on CUDA same-shape linears go through exllamav3's batch
encoder together: the routed (or drafter) experts of one layer and projection per K, and the wo_a
slices of one layer, in chunks that bound the fp32 weights held on the GPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from quantizer.contract.pack_spec import PackSpec
from quantizer.contract.stored_linear import StoredLinear
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.targets import DRAFT, ROUTED
from quantizer.quantize.results import Unit

GPU_BATCH_BYTES = 4 << 30  # fp32 weights of one batched unit on the GPU


def tensor_seed(job_seed: int, key: str) -> int:
    """A per-linear seed from the job seed and the stored key alone, so any subset of linears
    encodes identically whatever ran before it."""
    digest = hashlib.sha256(f"{job_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def plan_units(spec: PackSpec, codebook: str, job: dict) -> list[Unit]:
    """The work units of a pack spec's encoded linears under one job's settings (QuantizeSettings.record:
    seed, device, encoder, calibration fingerprint, quantizer version), each with its digest."""
    return [replace(u, digest=unit_digest(u, codebook, job)) for u in work_units(spec.encoded, job["device"])]


def unit_digest(unit: Unit, codebook: str, job: dict) -> str:
    """sha256 of what determines a unit's bytes: its linears (a stored key names the source rows), K,
    codebook and the job's settings, the Hessians' fingerprint among them. The source weights are the
    work directory's own (job.json refuses another source), so they are not hashed per unit."""
    body = {"keys": list(unit.keys), "K": unit.K, "codebook": codebook, "job": job}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
