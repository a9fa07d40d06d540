"""Opening what `ppl`, `eval` and the demo measure, the one way: a pack is scored only once its shards
match its manifest and, against a source, only against the checkpoint it was built from; a pack is read
as its loader would compute with (PackSource), the Engram tables its engine reads from beside it
included, a checkpoint as it is (CheckpointSource), in float32 on the CPU or bfloat16 on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.model.streaming import CheckpointSource, LayerStreamer, WeightSource
from quantizer.errors import UserError
from quantizer.pack.manifest import Manifest, is_pack
from quantizer.pack.owned import engram_dir
from quantizer.ppl.pack_source import PackSource, require_built_from, require_intact


def open_model(model: str | Path, revision: str | None = None) -> Checkpoint:
    """A checkpoint, or a pack with every tensor its engine reads: where the profile keeps the Engram
    tables in a directory beside the pack (tensorfold), that directory's too, and a missing one is named
    now, before any forward pass."""
    opened = Checkpoint.open(model, revision=revision)
    if is_pack(opened.root):
        sibling = engram_dir(opened.root, Manifest.load(opened.root))
        if sibling is not None:
            if not sibling.is_dir():
                raise UserError(f"{opened.root}: its Engram tables are kept beside it in {sibling}, which is missing; "
                                "copy that directory next to the pack as the build wrote it")
            opened = opened.with_tables_from(sibling)
    return opened


def open_measured(model: str, against: str | None = None, revision: str | None = None) -> tuple[Checkpoint, Checkpoint | None]:
    """MODEL (a pack or a checkpoint) and its source, refused before any forward pass when a pack's bytes
    are not its manifest's or it was not built from `against`."""
    opened = open_model(model, revision)
    reference = Checkpoint.open(against) if against else None
    if is_pack(opened.root):
        require_intact(opened)
        if reference is not None:
            require_built_from(opened, reference)
    return opened, reference


def weight_source(ck: Checkpoint) -> WeightSource:
    """The weights the forward computes with: a pack's decoded as its loader would, a checkpoint's as stored."""
    return PackSource(ck) if is_pack(ck.root) else CheckpointSource(ck)


def forward_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def streamer(ck: Checkpoint, device: str = "cpu", quiet: bool = False) -> LayerStreamer:
    """A layer-by-layer forward over `ck`; `quiet` for callers that print their own progress."""
    return LayerStreamer(weight_source(ck), device=device, dtype=forward_dtype(device), progress=not quiet,
                         report=(lambda line: None) if quiet else None)
