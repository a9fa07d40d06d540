"""What calibration tells the allocator: how much each tensor matters, in a few numbers per tensor.

The Hessians themselves (large) go to the quantize stage; the allocator only needs this summary,
which is small enough to hold for the 46,080 routed matrices of the real model, and simple enough
to synthesise for planning without a calibration run.

The file (summary.json, JSON) holds {"format": FORMAT, "version": VERSION} and the fields of
CalibrationSummary: `tensors` maps each EXL3 target key to its TensorStats, `layers` lists one
LayerStats per trunk layer (alias candidates as {"cold": [warm, error]}). `gains` says which site
sensitivity the summary carries: STREAM_ENERGY (every summary: the layers' attn_gain / ffn_gain,
write energy into the residual streams) or, in addition, MEASURED_KL (each layer's `unit_kl`: the
KL(native || perturbed) per token, nats, with only that unit's budgeted tensors at the noise level
`kl_relative_error` x their ldlq_factor, measured on `kl_rows` x `kl_cols` calibration tokens;
calibrate/unit_kl.py). Version 1 files (before unit_kl) load as STREAM_ENERGY summaries.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantizer.errors import UserError
from quantizer.model.targets import ENGRAM, ROUTED, SHARED
from quantizer.workdir import read_json, write_json_atomic

FORMAT = "quantizer-calibration-summary"
VERSION = 2
READABLE_VERSIONS = (1, 2)
STREAM_ENERGY, MEASURED_KL = "stream-energy", "measured-kl"
REFERENCE_RATE = 3.0  # measured unit KL is the cost at the error level of this K (the allocator's reference)

# The units whose KL calibration measures per layer; attention includes the indexer query.
ATTENTION_UNIT, ENGRAM_UNIT, SHARED_UNIT, ROUTED_UNIT = "attention", "engram", "shared", "routed"
KL_UNITS = (ATTENTION_UNIT, ENGRAM_UNIT, SHARED_UNIT, ROUTED_UNIT)


def kl_unit(group: str) -> str:
    """The measured unit of a budgeted target group (model/targets.py)."""
    return {ROUTED: ROUTED_UNIT, SHARED: SHARED_UNIT, ENGRAM: ENGRAM_UNIT}.get(group, ATTENTION_UNIT)


@dataclass
class TensorStats:
    """One EXL3 target (key = native weight name minus `.weight`)."""

    tokens: float  # tokens its input statistics come from (routed tokens for an expert's w2)
    out_energy: float  # E||W x||^2 per token over its calibration inputs, routing-weighted for experts
    ldlq_factor: float = 1.0  # LDLQ error / plain rounding error, from the Hessian (<= 1; 1 = no help)


@dataclass
class LayerStats:
    layer: int  # trunk layer index
    expert_tokens: list[float]  # routed selections per expert (top-k counts)
    expert_weight: list[float]  # sum of squared routing weights per expert
    attn_gain: float = 1.0  # relative write gain of the attention site into the residual streams
    ffn_gain: float = 1.0  # same for the MoE/FFN site
    # cold expert -> (most similar warm expert, relative output error if aliased to it)
    alias_candidates: dict[int, tuple[int, float]] = field(default_factory=dict)
    # unit (KL_UNITS) -> measured KL at the probe's noise level; empty when not measured
    unit_kl: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready: alias keys as strings, pairs as lists."""
        body = asdict(self)
        body["alias_candidates"] = {str(k): list(v) for k, v in self.alias_candidates.items()}
        return body

    @classmethod
    def from_dict(cls, data: dict) -> "LayerStats":
        aliases = {int(k): (int(v[0]), float(v[1])) for k, v in data["alias_candidates"].items()}
        return cls(**{**data, "alias_candidates": aliases})


@dataclass
class CalibrationSummary:
    source_fingerprint: str
    rows: int
    cols: int
    tensors: dict[str, TensorStats]
    layers: list[LayerStats]
    synthetic: bool = False  # True when made up for planning without a calibration run
    kl_relative_error: float = 0.0  # the unit KL probe's noise per unit of ldlq_factor (0: not measured)
    kl_rows: int = 0
    kl_cols: int = 0

    @property
    def gains(self) -> str:
        """MEASURED_KL when every layer carries measured unit KLs, else STREAM_ENERGY."""
        measured = self.kl_relative_error > 0 and self.layers and all(layer.unit_kl for layer in self.layers)
        return MEASURED_KL if measured else STREAM_ENERGY

    def layer(self, index: int) -> LayerStats:
        for stats in self.layers:
            if stats.layer == index:
                return stats
        raise KeyError(index)

    def to_dict(self) -> dict:
        body = asdict(self)
        body["layers"] = [layer.to_dict() for layer in self.layers]
        return {"format": FORMAT, "version": VERSION, "gains": self.gains, **body}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibrationSummary":
        data = read_json(path, "calibration summary not found; run `quantizer calibrate` first",
                         "run `quantizer calibrate` again")
        if data.get("format") != FORMAT or data.get("version") not in READABLE_VERSIONS:
            raise UserError(f"{path}: not a quantizer calibration summary (format {FORMAT} v{VERSION}); "
                            "run `quantizer calibrate` again")
        layers = [LayerStats.from_dict(layer) for layer in data["layers"]]
        tensors = {k: TensorStats(**v) for k, v in data["tensors"].items()}
        return cls(data["source_fingerprint"], data["rows"], data["cols"], tensors, layers, data.get("synthetic", False),
                   data.get("kl_relative_error", 0.0), data.get("kl_rows", 0), data.get("kl_cols", 0))
