"""A pack measured in the engine that serves it: stock exllamav3 (the `gpu` extra and a CUDA device).

exllamav3's logits on token rows, as the `RowPredictions` our comparison reads, and what any EXL3
pack holds per target of ours (K and bytes), whoever wrote it: exllamav3's own converter writes no
manifest, so its K map and bits are read from its trellis shapes (K = trellis width / 16,
docs/exl3-format.md). The GPU tests and bench/converter_curve.py measure with these.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.loader_profiles import stock_profile
from quantizer.contract.plan import Plan
from quantizer.contract.rules import achieved_bpw
from quantizer.model.targets import targets
from quantizer.ppl.perplexity import RowPredictions


def exllamav3_logits(path: str | Path, rows: torch.Tensor) -> torch.Tensor:
    """float32 logits [rows, cols, vocab] on the CPU of the model or pack at `path`, loaded by exllamav3
    and run one row at a time (no cache: each row is a fresh sequence)."""
    from exllamav3 import Config, Model

    model = Model.from_config(Config.from_directory(str(path)))
    model.load()
    try:
        return torch.cat([model.forward(row[None].cuda(), {"attn_mode": "flash_attn_nc"}).float().cpu()
                          for row in rows])
    finally:
        model.unload()


def predictions(logits: torch.Tensor, rows: torch.Tensor) -> list[RowPredictions]:
    """Per row, the log-probabilities of `logits` for tokens 1.. and the tokens they predict."""
    return [RowPredictions(i, torch.log_softmax(lg[:-1].float(), dim=-1), row[1:])
            for i, (lg, row) in enumerate(zip(logits, rows))]


def exllamav3_predictions(path: str | Path, rows: torch.Tensor) -> list[RowPredictions]:
    return predictions(exllamav3_logits(path, rows), rows)


def target_of(name: str) -> str:
    """`layers.0.attn.wo_a.slice.1.trellis` -> `layers.0.attn.wo_a`: the target a stored tensor belongs to."""
    return name.rsplit(".", 1)[0].split(".slice.")[0]


def stored_k(pack: str | Path, cfg: ModelConfig) -> dict[str, float | None]:
    """The K a pack holds per target (a wo_a's slices: the lowest; None: not EXL3)."""
    widths: dict[str, list[int]] = {}
    for name, e in Checkpoint.open(pack).tensors.items():
        if name.endswith(".trellis"):
            widths.setdefault(target_of(name), []).append(e.shape[2])
    return {t.key: min(widths[t.key]) / 16 if t.key in widths else None for t in targets(cfg)}


def stored_bpw(pack: str | Path, cfg: ModelConfig) -> float:
    """The pack's bits per weight over our budgeted targets (our accounting; not EXL3: 16 bits)."""
    k = {key: 16.0 if v is None else v for key, v in stored_k(pack, cfg).items()}
    return achieved_bpw(cfg, Plan(cfg.arch, "mul1", stock_profile(), k))


def budgeted_bytes(pack: str | Path) -> int:
    """Bytes of the stored tensors of the budgeted targets (wo_a slices included)."""
    ck = Checkpoint.open(pack)
    keys = {t.key for t in targets(ck.config) if t.budgeted}
    return sum(e.nbytes for name, e in ck.tensors.items() if target_of(name) in keys)
