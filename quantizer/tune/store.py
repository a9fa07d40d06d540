"""`WORK/tuned/`: one safetensors file per tuned block, holding the fp16 suh/svh of its EXL3 linears.

Like the quantize stage's unit store (quantize/results.py), a file is named by the digest of everything
that determines it (the block's unit digests, the tuning settings, the calibration rows and, when block
inputs come from the tuned blocks before it, their digests), appears by rename, and is reused by a rerun;
one that cannot be read back is deleted and its block tuned again. A stage that finished leaves
`<stage>.done.json` with its settings and rows, so a rerun of the same build knows before any stage that
it needs none of the stage's memory (`finished`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from quantizer.checkpoint.safetensors_file import PAD_PREFIX, TensorEntry, planned, read_header, read_tensor, write_safetensors
from quantizer.errors import UserError
from quantizer.exl3 import PACK_ALIGN
from quantizer.workdir import write_json_atomic

TUNED_DIR = "tuned"
SUFFIX = ".safetensors"
DIGEST_CHARS = 16
DONE_SUFFIX = ".done.json"


def run_record(settings: dict, rows_digest: str) -> dict:
    """What a finished run of a tuning stage is recorded by: its settings and its calibration rows' digest
    (calibrate.stage.tokens_digest)."""
    return {"settings": settings, "rows": rows_digest}


def finished(work: Path, stage: str, record: dict) -> bool:
    """Whether a run of `stage` under `record` (run_record) finished in `work`, so that a rerun reuses its
    files. Only reads: build asks before it claims the work directory. A rerun whose codes changed since
    tunes again; the stage then checks its memory itself."""
    try:
        return json.loads((Path(work) / TUNED_DIR / f"{stage}{DONE_SUFFIX}").read_text()) == record
    except (OSError, ValueError):
        return False


def block_digest(block: str, unit_digests: list[str], settings: dict, rows_digest: str, previous: str | None) -> str:
    body = {"block": block, "units": unit_digests, "settings": settings, "rows": rows_digest, "previous": previous}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TunedStore:
    def __init__(self, work: Path):
        self.dir = Path(work) / TUNED_DIR
        self.dir.mkdir(parents=True, exist_ok=True)

    def mark_finished(self, stage: str, record: dict) -> None:
        write_json_atomic(self.dir / f"{stage}{DONE_SUFFIX}", record)

    def drop_unfinished(self) -> None:
        for stale in self.dir.glob("*.tmp"):
            stale.unlink()

    def path(self, block: str, digest: str) -> Path:
        return self.dir / f"{block}.{digest[:DIGEST_CHARS]}{SUFFIX}"

    def load(self, block: str, digest: str, keys: list[str]) -> dict[str, torch.Tensor] | None:
        """The block's stored suh/svh by tensor name, or None when it is not (readably) there."""
        path = self.path(block, digest)
        if not path.exists():
            return None
        try:
            entries = read_header(path).tensors
            wanted = [f"{k}.{leaf}" for k in keys for leaf in ("suh", "svh")]
            if all(n in entries for n in wanted):
                return {n: read_tensor(entries[n]) for n in wanted}
        except UserError:
            pass
        path.unlink()
        return None

    def save(self, block: str, digest: str, tensors: dict[str, torch.Tensor], info: dict) -> None:
        write_safetensors(self.path(block, digest), [planned(n, t) for n, t in tensors.items()],
                          metadata={"info": json.dumps(info)}, align=PACK_ALIGN)

    def entries(self, paths: list[Path]) -> dict[str, TensorEntry]:
        """Every suh/svh in these block files, by name: what the pack writer copies instead of the unit store's."""
        out: dict[str, TensorEntry] = {}
        for path in paths:
            out.update({n: e for n, e in read_header(path).tensors.items() if not n.startswith(PAD_PREFIX)})
        return out

    def info(self, path: Path) -> dict:
        return json.loads(read_header(path).metadata.get("info", "{}"))
