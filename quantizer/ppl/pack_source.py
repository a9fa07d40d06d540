"""A pack as a weight source for the reference forward: what a loader of the pack would compute with.

EXL3 linears are decoded (on the device the forward runs on) to the weights exllamav3 reconstructs,
`wo_a` from its per-group slices; native tensors are read as stored; an aliased cold expert is
served by the expert the manifest names. Streaming loads one block at a time, so a large pack is
decoded layer by layer.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from quantizer.checkpoint.fingerprint import sha256_file, source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import EXL3Linear, dequantize
from quantizer.errors import UserError
from quantizer.exl3 import EXL3_LEAVES
from quantizer.model.streaming import CheckpointSource
from quantizer.pack.manifest import MANIFEST_NAME, Manifest
from quantizer.pack.owned import engram_records


def require_intact(pack: Checkpoint) -> None:
    """UserError when the manifest's claims were edited (its aliases say which expert serves which), or
    naming the first recorded file or shard (the sibling Engram directory's too) whose sha256 is not the
    manifest's: a flipped byte in a trellis decodes to slightly other weights and would measure a plausible,
    wrong number. `ppl` and `eval` call it before they score a pack. The shards are hashed in parallel
    threads (sha256 runs at about 1 GiB/s per core), one read of the pack before the measure."""
    manifest = Manifest.load(pack.root)
    manifest.require_claims(pack.root / MANIFEST_NAME)
    manifest.require_files(pack.root)  # the tokenizer the text is cut with, the config the forward is built from
    recorded = {pack.root / s.file: s.sha256 for s in manifest.shards}
    recorded |= {path: r.sha256 for path, r in engram_records(pack.root, manifest).items()}  # tables read beside it
    paths = list(recorded)
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: missing; run `quantizer verify --full {pack.root}`")
    with tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="sha256") as bar, \
            ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1) or 1) as pool:
        digests = list(pool.map(lambda p: sha256_file(p, bar.update), paths))
    for path, digest in zip(paths, digests):
        if digest != recorded[path]:
            raise UserError(f"{path}: sha256 {digest[:16]}... is not the manifest's {recorded[path][:16]}... (the "
                            f"shard changed since it was packed); run `quantizer verify --full {pack.root}` and "
                            "rebuild or copy the pack again")


def require_built_from(pack: Checkpoint, source: Checkpoint) -> None:
    """UserError unless `source` is the checkpoint the manifest says `pack` was built from: a KL
    against another checkpoint (another architecture even) would be a number without meaning.
    The check hashes every shard of `source` once (checkpoint/fingerprint.py), one more read of it."""
    recorded = Manifest.load(pack.root).source
    if recorded.get("arch") != source.config.arch:
        raise UserError(f"{source.root}: a {source.config.arch} checkpoint, but {pack.root} was built from a "
                        f"{recorded.get('arch')} one ({recorded.get('path')}); compare a pack with its own source")
    found = source_fingerprint(source)
    if found != recorded.get("fingerprint"):
        raise UserError(f"{source.root}: not the checkpoint {pack.root} was built from (its fingerprint is {found}, "
                        f"the manifest records {recorded.get('fingerprint')} from {recorded.get('path')}); "
                        "compare a pack with its own source")


class PackSource(CheckpointSource):
    def __init__(self, pack: Checkpoint):
        super().__init__(pack)
        self.aliases: dict[str, str] = Manifest.load(pack.root).aliases

    def weight(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        key = name[: -len(".weight")] if name.endswith(".weight") else None
        if key is None:
            return super().weight(name, dtype, device)
        key = self.aliases.get(key, key)
        if f"{key}.trellis" in self.checkpoint:
            return self._decode(key, device).to(dtype)
        if f"{key}.slice.0.trellis" in self.checkpoint:
            slices, g = [], 0
            while f"{key}.slice.{g}.trellis" in self.checkpoint:
                slices.append(self._decode(f"{key}.slice.{g}", device))
                g += 1
            return torch.cat(slices).to(dtype)
        return super().weight(f"{key}.weight", dtype, device)

    def _decode(self, key: str, device) -> torch.Tensor:
        """The HF-orientation [out, in] float32 weight of one EXL3 linear."""
        leaves = {f"{key}.{leaf}": self.checkpoint.raw(f"{key}.{leaf}").to(device)
                  for leaf in EXL3_LEAVES if f"{key}.{leaf}" in self.checkpoint}
        try:
            return dequantize(EXL3Linear.from_tensors(leaves, key))
        except ValueError as e:
            raise UserError(f"{self.checkpoint.root}: {key}: {e}")
