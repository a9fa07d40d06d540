"""`quantizer make-tiny`: native checkpoints with every component, small (random) or full-size (sparse).

Tiny checkpoints hold random weights in the native formats (FP8 + E8M0 grids, MXFP4 experts,
BF16/F32/I64 small tensors) so every code path runs in CI. Full-size layouts write the exact headers
of the real V4.1-Flash checkpoint and leave the data as holes in sparse files: no disk is used, and
inventory, planning and fit run against the real 96,085 tensors.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from quantizer.checkpoint.dequant import quantize_fp8_blocks, quantize_mxfp4
from quantizer.checkpoint.safetensors_file import PlannedTensor, planned, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME
from quantizer.errors import UserError
from quantizer.model.config import ModelConfig
from quantizer.model.layout import TensorSpec, native_layout
from quantizer.model.tensor_classes import ENGRAM_RESIDENT, ENGRAM_TABLE, classify
from quantizer.shipped import model_config_path

TINY_CONFIGS = {"v41": "tiny-v41.json", "v4": "tiny-v4.json"}
FULL_CONFIGS = {"v41": "deepseek-v4.1-flash.json", "v4": "deepseek-v4-flash-0731.json"}
FULL_BACKBONE_SHARDS = 46  # the real V4.1-Flash has 48 shards, the last two holding the Engram tables


def make_tiny(out: str | Path, arch: str, seed: int = 0, full_size: bool = False, sparse: bool = False) -> Path:
    if arch not in TINY_CONFIGS:
        raise UserError(f"unknown --arch {arch!r}; choose v41 or v4")
    if full_size and not sparse:
        raise UserError("--full-size writes hundreds of GB; add --sparse to write headers and holes only")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: directory exists and is not empty; choose a new output directory")
    raw = json.loads(model_config_path((FULL_CONFIGS if full_size else TINY_CONFIGS)[arch]).read_text())
    cfg = ModelConfig.from_dict(raw)
    specs = native_layout(cfg)
    shards = assign_shards(specs, FULL_BACKBONE_SHARDS if full_size else 2)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(tqdm(shards, desc="shards", unit="shard", disable=len(shards) < 8)):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = [_planned(spec, cfg, gen, sparse) for spec in group]
        write_safetensors(tmp / fname, [t for pair in tensors for t in pair], align=1)
        for pair in tensors:
            for t in pair:
                weight_map[t.name] = fname
                total += t.nbytes
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


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


def _planned(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator, sparse: bool) -> list[PlannedTensor]:
    """The stored tensor(s) for one spec; a random weight is written together with its scale grid."""
    if sparse:
        return [PlannedTensor(spec.name, spec.dtype, spec.shape, None)]
    if spec.name.endswith(".scale"):
        return []
    scale_name = spec.name[: -len(".weight")] + ".scale"
    if spec.dtype == "I64":
        return [planned(spec.name, _expert_table(spec.shape, cfg, gen))]
    if spec.dtype == "I8":
        w, s = quantize_mxfp4(_values(spec.name, (spec.shape[0], spec.shape[1] * 2), gen))
        return [planned(spec.name, w), planned(scale_name, s, "F8_E8M0")]
    values = _values(spec.name, spec.shape, gen)
    if spec.dtype == "F8_E4M3":
        block = (1, 32) if ".engram.embed." in spec.name else cfg.fp8_block
        w, s = quantize_fp8_blocks(values, block)
        return [planned(spec.name, w), planned(scale_name, s, "F8_E8M0")]
    return [planned(spec.name, values.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32))]


def _values(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values of a plausible scale for each kind of tensor, so forwards stay finite."""
    x = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if leaf in ("attn_sink",):
        return 0.5 * x
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.01 * x
    if "hc_" in name:
        if name.endswith("_scale"):
            return 0.5 + 0.1 * x.abs()
        return 0.02 * x if name.endswith("_fn") else 0.1 * x
    if leaf == "ape":
        return 0.02 * x
    if name == "embed.weight" or ".engram.embed." in name:
        return x
    fan_in = shape[-1] if len(shape) > 1 else 1
    return x / math.sqrt(fan_in)


def _expert_table(shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Hash-routing table: k distinct experts per token id."""
    rows, k = shape
    return torch.rand(rows, cfg.n_routed_experts, generator=gen).argsort(dim=1)[:, :k].contiguous()
