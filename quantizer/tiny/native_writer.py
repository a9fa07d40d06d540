"""Write a checkpoint in DeepSeek's native format from real-valued tensors.

Used by `make-tiny` (random values, or none at all for sparse full-size layouts) and by the export of
the bundled small model (trained values). Each tensor is stored as `native_layout` says: FP8 e4m3
with its E8M0 block grid, MXFP4 experts, BF16, F32, I64; Engram tables in shards of their own.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.dequant import quantize_fp8_blocks, quantize_mxfp4
from quantizer.checkpoint.safetensors_file import PlannedTensor, planned, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME, is_engram_table
from quantizer.errors import UserError
from quantizer.model.layout import TensorSpec, native_layout
from quantizer.model.tensor_classes import ENGRAM_RESIDENT, ENGRAM_TABLE, classify

# values(spec) -> a weight's real values (the logical shape: FP4 experts [out, in]).
ValueFn = Callable[[TensorSpec], torch.Tensor]


def write_native_checkpoint(
    out: str | Path,
    raw_config: dict,
    values: ValueFn | None,
    backbone_shards: int,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """Write config.json, shards and index to `out` (which must not exist or be empty), atomically.
    values=None writes a sparse layout: exact headers, every tensor's bytes left as a hole."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: directory exists and is not empty; choose a new output directory")
    cfg = ModelConfig.from_dict(raw_config)
    shards = assign_shards(native_layout(cfg), backbone_shards)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A partial directory of this run's own: a concurrent run, or a user's `<out>.partial`, is not touched.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the checkpoint's
    try:
        _write_into(tmp, raw_config, cfg, shards, values, extra_files)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_into(tmp: Path, raw_config: dict, cfg: ModelConfig, shards: list[list[TensorSpec]],
                values: ValueFn | None, extra_files: dict[str, Path] | None) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(tqdm(shards, desc="shards", unit="shard", disable=len(shards) < 8)):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        stored = [t for spec in group for t in stored_tensors(spec, values, cfg)]
        write_safetensors(tmp / fname, stored, align=1)
        for t in stored:
            weight_map[t.name] = fname
            total += t.nbytes
    (tmp / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / name)


def assign_shards(specs: list[TensorSpec], backbone_shards: int) -> list[list[TensorSpec]]:
    """Backbone tensors cut into shards of similar size; each Engram layer in a shard of its own
    (table and resident projections together, as DeepSeek ships them)."""
    engram: dict[int, list[TensorSpec]] = {}
    backbone: list[TensorSpec] = []
    for s in specs:
        c = classify(s.name)
        if c.cls in (ENGRAM_TABLE, ENGRAM_RESIDENT):
            engram.setdefault(c.layer, []).append(s)
        else:
            backbone.append(s)
    target = math.ceil(sum(s.nbytes for s in backbone) / backbone_shards)
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in backbone:
        if size >= target and len(groups) < backbone_shards:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    return groups + [engram[layer] for layer in sorted(engram)]


def stored_tensors(spec: TensorSpec, values: ValueFn | None, cfg: ModelConfig) -> list[PlannedTensor]:
    """The stored tensor(s) for one spec. A quantized weight is stored together with its scale grid,
    so `.scale` specs produce nothing themselves; values=None leaves every tensor as a hole. Values may
    come on any device (the rehearsal makes them on a GPU); the stored bytes are on the CPU."""
    if values is None:
        return [PlannedTensor(spec.name, spec.dtype, spec.shape, None)]
    if spec.name.endswith(".scale"):
        return []
    return [planned(t.name, t.data.cpu(), t.dtype) for t in _encoded(spec, values(spec), cfg)]


def _encoded(spec: TensorSpec, x: torch.Tensor, cfg: ModelConfig) -> list[PlannedTensor]:
    scale_name = spec.name[: -len(".weight")] + ".scale"
    if spec.dtype == "I8":
        w, s = quantize_mxfp4(x)
        return [planned(spec.name, w), planned(scale_name, s, "F8_E8M0")]
    if spec.dtype == "F8_E4M3":
        block = (1, 32) if is_engram_table(spec.name) else cfg.fp8_block
        w, s = quantize_fp8_blocks(x, block)
        return [planned(spec.name, w), planned(scale_name, s, "F8_E8M0")]
    if spec.dtype == "I64":
        return [planned(spec.name, x.to(torch.int64))]
    return [planned(spec.name, x.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32))]
