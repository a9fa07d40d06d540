"""How many GPU-hours a plan's quantize stage takes, from encode rates measured per K.

exllamav3's encoder speed depends on K (a half-integer rate costs about a third more time per weight
than its integer neighbours) and a little on the tensor's shape. `configs/encode_rates/<encoder>.json`
holds the rates of one quantize encoder (`ours`, `exllamav3`) measured by bench/quantize_gpu.py on the GPU
it names, with where they came from. Another encoder's table may name exllamav3's as its `fallback` for
the K it has not measured; those K are priced at exllamav3's rates and the statement names them. Any other K a table
lacks is priced at the nearest measured K of the same kind (integer or half-integer), a shape at the
nearest measured input width, and the statement names the K so priced.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.pack_spec import stored_linears
from quantizer.contract.plan import Plan
from quantizer.contract.stored_linear import StoredLinear
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED
from quantizer.quantize.settings import ENCODERS
from quantizer.shipped import shipped

RATES_FORMAT = "quantizer-encode-rates"
DEFAULT_ENCODER = ENCODERS["cuda"][0]  # the quantize stage's default on CUDA
REFERENCE_ENCODER = "exllamav3"  # the format owner's own conversion: the table any other may fall back to


@dataclass(frozen=True)
class EncodeRate:
    K: float
    in_features: int
    out_features: int
    weights_per_s: float


@dataclass(frozen=True)
class RateTable:
    device: str  # "NVIDIA H200"
    rates: tuple[EncodeRate, ...]
    encoder: str = DEFAULT_ENCODER
    fallback: "RateTable | None" = None  # prices the K this table has not measured

    @classmethod
    def load(cls, encoder: str = DEFAULT_ENCODER) -> "RateTable":
        path = shipped("configs", "encode_rates", f"{encoder}.json")
        try:
            data = json.loads(path.read_text())
            rates = tuple(EncodeRate(float(r["K"]), int(r["in_features"]), int(r["out_features"]),
                                     float(r["weights_per_s"])) for r in data["rates"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: not a readable encode-rate table ({e})") from None
        if data.get("format") != RATES_FORMAT or not rates or min(r.weights_per_s for r in rates) <= 0:
            raise UserError(f"{path}: not a {RATES_FORMAT} table with positive rates")
        fallback = data.get("fallback")
        if fallback is not None and (fallback != REFERENCE_ENCODER or encoder == REFERENCE_ENCODER):
            raise UserError(f"{path}: fallback {fallback!r}; only another encoder's table may fall back, and only "
                            f"to {REFERENCE_ENCODER}'s")
        return cls(str(data["device"]), rates, encoder, cls.load(REFERENCE_ENCODER) if fallback else None)

    def rate(self, K: float, in_features: int) -> tuple[float, str]:
        """(weights/s for a linear of this K and input width, how it was priced: "measured", "fallback" (the
        fallback table's rate at this K) or "nearest" (a neighbouring K's))."""
        if self.fallback and K not in {r.K for r in self.rates} and K in {r.K for r in self.fallback.rates}:
            return self.fallback.rate(K, in_features)[0], "fallback"
        half = not float(K).is_integer()
        same_kind = [r for r in self.rates if (not r.K.is_integer()) == half] or list(self.rates)
        nearest_k = min(same_kind, key=lambda r: abs(r.K - K)).K
        at_k = [r for r in same_kind if r.K == nearest_k]
        best = min(at_k, key=lambda r: abs(math.log(r.in_features / in_features)))
        return best.weights_per_s, "measured" if nearest_k == K else "nearest"


@dataclass(frozen=True)
class QuantizeEstimate:
    weights: int  # weights encoded as EXL3 (fp16 linears are only cast)
    seconds: float  # on one GPU
    device: str
    unmeasured: tuple[float, ...]  # K values priced at a neighbouring K's rate
    encoder: str = DEFAULT_ENCODER
    fallback: tuple[float, ...] = ()  # K values priced at the fallback table's (exllamav3's own) rates

    @property
    def gpu_hours(self) -> float:
        return self.seconds / 3600

    def line(self, device: str = "cuda") -> str:
        """The statement `plan` and `build` print; for a build on the CPU (`device` "cpu") no GPU figure: the
        rates are a GPU's, and none is measured for quantizer's CPU codec."""
        weights = f"{self.weights / 1e9:,.1f} G" if self.weights >= 1e8 else f"{self.weights:,}"
        gpu = self.device.removeprefix("NVIDIA ")
        if device == "cpu":
            return (f"quantize: the plan's {weights} weights go to quantizer's codec on the CPU; no time estimate "
                    f"(encode rates are measured on {gpu} GPUs only)")
        hours = f"~{self.gpu_hours:,.1f}" if self.gpu_hours >= 0.05 else "under 0.1"
        text = f"quantize: {weights} weights, {hours} GPU-hours on {gpu} at measured rates"
        notes = [f"--encoder {self.encoder}"] if self.encoder != DEFAULT_ENCODER else []
        if self.fallback:
            notes.append(f"K {_ks(self.fallback)} at exllamav3's own rates, not yet measured with it")
        if self.unmeasured:
            notes.append(f"K {_ks(self.unmeasured)} at the nearest measured K's rate")
        return text + (f" ({'; '.join(notes)})" if notes else "")


def _ks(ks: tuple[float, ...]) -> str:
    return ", ".join(f"{k:g}" for k in ks)


def estimate(linears: Iterable[StoredLinear], table: RateTable) -> QuantizeEstimate:
    weights, seconds, priced = 0, 0.0, {"nearest": set(), "fallback": set()}
    for s in linears:
        if s.K == UNQUANTIZED:
            continue
        rate, how = table.rate(s.K, s.in_features)
        weights += s.numel
        seconds += s.numel / rate
        if how in priced:
            priced[how].add(s.K)
    return QuantizeEstimate(weights, seconds, table.device, tuple(sorted(priced["nearest"])), table.encoder,
                            tuple(sorted(priced["fallback"])))


def plan_estimate(cfg: ModelConfig, plan: Plan, table: RateTable | None = None) -> QuantizeEstimate:
    """The GPU time of quantizing every linear `plan` stores as EXL3 (default: with the default encoder's rates)."""
    return estimate((s for s in stored_linears(cfg, plan) if s.K is not None), table or RateTable.load())
