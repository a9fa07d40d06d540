"""What a pack stores, tensor by tensor, read back from its safetensors headers.

A plan's tensors come from its pack spec (contract/pack_spec.py); this reads the same `StoredTensor` rows from
a written pack (or a native checkpoint), so fit sizes a plan and the pack built from it alike.
"""

from __future__ import annotations

from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import PAD_PREFIX
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.pack_spec import EXL3, NATIVE, StoredTensor
from quantizer.errors import UserError
from quantizer.exl3 import EXL3_LEAVES, k_from_trellis
from quantizer.model.tensor_classes import classify

__all__ = ["EXL3", "NATIVE", "StoredTensor", "exl3_key", "stored_from_pack"]


def exl3_key(name: str) -> tuple[str, str] | None:
    """(key, leaf) if `name` is named like an EXL3 leaf (`layers.3.attn.wq_a.trellis`)."""
    key, _, leaf = name.rpartition(".")
    return (key, leaf) if key and leaf in EXL3_LEAVES else None


def stored_from_pack(pack_dir: str | Path) -> tuple[ModelConfig, list[StoredTensor]]:
    """Read a pack's (or a native checkpoint's) headers: a linear is EXL3 when it stores
    `<key>.trellis` + `.suh` + `.svh`; K = trellis.shape[-1] / 16. Alignment pads are skipped. Headers
    cannot tell an fp16 linear from a native bf16 weight, so only EXL3 leaves name their linear."""
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
        key = parsed[0] if parsed and parsed[0] in exl3_k else None
        stored.append(StoredTensor(name, e.nbytes, tuple(e.shape), e.dtype, classify(name).cls,
                                   EXL3 if key else NATIVE, exl3_k[key] if key else None, key, e.offset))
    return ck.config, stored
