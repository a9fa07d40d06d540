"""`quantizer make-tiny`: native checkpoints with every component, small (random) or full-size (sparse).

Tiny checkpoints hold random weights in the native formats (FP8 + E8M0 grids, MXFP4 experts,
BF16/F32/I64 small tensors) so every code path runs in CI. Full-size layouts write the exact headers
of the real V4.1-Flash checkpoint and leave the data as holes in sparse files: no disk is used, and
inventory, planning and fit run against the real 96,085 tensors.

A tiny V4 checkpoint also carries the shipped 4,096-token tokenizer (its vocabulary size), since
exllamav3's converter reads the model directory's tokenizer.json. Tiny V4.1 gets one only with `tokenizer`
(`make-tiny --tokenizer`): a tokenizer switches its Engram hash from raw token ids to the compressed map
(model/engram.py), whose size the config must state (engram_compressed_vocab_size: 2,779 for the shipped
tokenizer; the tables' sizes come from engram_vocab_size and do not change). The one-Spark engine reads
tokenizer.json (configs/loaders/exllamav3-v41.json, required_files), so that is the checkpoint it builds from;
without the flag the tiny checkpoint and every forward number measured on it stay as they were.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from quantizer.checkpoint.config import V4, ModelConfig
from quantizer.checkpoint.source import is_engram_table
from quantizer.errors import UserError
from quantizer.model.engram import compressed_token_map
from quantizer.model.layout import TensorSpec
from quantizer.shipped import model_config_path
from quantizer.textdata import default_tokenizer, shipped_tokenizer_path
from quantizer.tiny.native_writer import ValueFn, write_native_checkpoint

TINY_CONFIGS = {"v41": "tiny-v41.json", "v4": "tiny-v4.json"}
FULL_CONFIGS = {"v41": "deepseek-v4.1-flash.json", "v4": "deepseek-v4-flash-0731.json"}
FULL_BACKBONE_SHARDS = 46  # the real V4.1-Flash has 48 shards, the last two holding the Engram tables


def make_tiny(out: str | Path, arch: str, seed: int = 0, full_size: bool = False, sparse: bool = False,
              tokenizer: bool = False) -> Path:
    if arch not in TINY_CONFIGS:
        raise UserError(f"unknown --arch {arch!r}; choose v41 or v4")
    if full_size and not sparse:
        raise UserError("--full-size writes hundreds of GB; add --sparse to write headers and holes only")
    if full_size and tokenizer:
        raise UserError("--tokenizer writes the tiny models' tokenizer; the full-size layout's Engram map needs the "
                        "real model's, and it has no weights to build from")
    raw = json.loads(model_config_path((FULL_CONFIGS if full_size else TINY_CONFIGS)[arch]).read_text())
    cfg = ModelConfig.from_dict(raw)
    if tokenizer and cfg.engram_layer_ids:
        _, compressed = compressed_token_map(default_tokenizer())
        raw.get("text_config", raw)["engram_compressed_vocab_size"] = compressed
        cfg = ModelConfig.from_dict(raw)
    shards = FULL_BACKBONE_SHARDS if full_size else 2
    values = random_values(cfg, torch.Generator().manual_seed(seed))
    extra = {"tokenizer.json": shipped_tokenizer_path()} if (cfg.arch == V4 or tokenizer) and not full_size else None
    return write_native_checkpoint(out, raw, None if sparse else values, shards, extra_files=extra)


def random_values(cfg: ModelConfig, gen: torch.Generator) -> ValueFn:
    """Random real values for every tensor of `cfg`, made on the generator's device (a CUDA generator
    makes a full-width checkpoint in seconds)."""

    def values(spec: TensorSpec) -> torch.Tensor:
        if spec.dtype == "I64":
            return _expert_table(spec.shape, cfg, gen)
        shape = (spec.shape[0], spec.shape[1] * 2) if spec.dtype == "I8" else spec.shape
        return _values(spec.name, shape, gen)

    return values


def _values(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values of a plausible scale for each kind of tensor, so forwards stay finite."""
    x = torch.randn(shape, generator=gen, device=gen.device)
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
    if name == "embed.weight" or is_engram_table(name):
        return x
    fan_in = shape[-1] if len(shape) > 1 else 1
    return x / math.sqrt(fan_in)


def _expert_table(shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Hash-routing table: k distinct experts per token id."""
    rows, k = shape
    return torch.rand(rows, cfg.n_routed_experts, generator=gen, device=gen.device).argsort(dim=1)[:, :k].contiguous()
