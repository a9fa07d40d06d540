"""How long a calibration takes, stated before it starts, from a rate measured on the bundled model.

`configs/calibrate_rates/<device>.json` holds two rates in model FLOPs per second (model/flops.py: every
layer's forward and the head), as bench/calibrate_cpu.py fits them to whole `calibrate` runs, each part
timed on its own: the pass over the rows (its forward, with the Hessian sums and each layer's finish
riding on it), and the unit KL probe where it runs (unit_kl.py: where the dequantized model fits in
memory): one forward of its rows, then per (layer, unit) the layers from that one on and the head. The
two run at different rates (the probe holds the whole dequantized model and reruns short rows: on the
bundled model 37 G/s against the pass's 15 G/s), and the probe is a third to half of a run of the bundled
model, so each has its own. The line before the first layer states the whole run; the probe, a phase of
its own, is announced again with its share as it starts (`unit_kl_line`). bench/calibrate_cpu.py checks
both against measured runs within 25%. A device without a measured rate gets the rows without a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.unit_kl import fits, free_memory, unit_keys, unit_kl_needs
from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.model.flops import layer_flops, model_flops
from quantizer.shipped import shipped

RATES_FORMAT = "quantizer-calibrate-rates"


@dataclass(frozen=True)
class CalibrationRate:
    device: str  # "2 idle CPU cores"
    pass_flops_per_s: float  # model FLOPs per second of the pass over the rows
    probe_flops_per_s: float  # model FLOPs per second of the unit KL probe

    @classmethod
    def load(cls, device: str) -> "CalibrationRate | None":
        """The measured rate of `device` ("cpu", "cuda"), or None where none was measured."""
        path = shipped("configs", "calibrate_rates", f"{device}.json")
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            rate = cls(str(data["device"]), float(data["pass_flops_per_s"]), float(data["probe_flops_per_s"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}: not a readable calibration-rate table ({e})") from None
        if data.get("format") != RATES_FORMAT or min(rate.pass_flops_per_s, rate.probe_flops_per_s) <= 0:
            raise UserError(f"{path}: not a {RATES_FORMAT} table with positive rates")
        return rate

    def seconds(self, flops: tuple[float, float]) -> float:
        """Seconds of a run of (pass, probe) FLOPs (calibration_flops)."""
        return flops[0] / self.pass_flops_per_s + flops[1] / self.probe_flops_per_s


def calibration_flops(cfg: ModelConfig, rows: int, cols: int, settings: CalibrationSettings) -> tuple[float, float]:
    """(the pass's, the unit KL probe's) model FLOPs of a calibration of rows x cols tokens; the probe's 0
    where it does not run."""
    r, c = min(rows, settings.kl_rows), min(cols, settings.kl_cols)
    if settings.measure_kl is False or not fits(unit_kl_needs(cfg, r, c, settings.dtype), free_memory(settings.device)):
        return model_flops(cfg, rows, cols), 0.0
    return model_flops(cfg, rows, cols), probe_flops(cfg, r, c)


def probe_flops(cfg: ModelConfig, rows: int, cols: int) -> float:
    """Model FLOPs of the unit KL probe on rows x cols tokens: one forward, then per (layer, unit) the
    layers from that one on and the head."""
    head = 2 * cols * cfg.hidden_size * cfg.vocab_size
    after = [sum(layer_flops(cfg, later, cols) for later in range(layer, cfg.num_layers)) for layer in range(cfg.num_layers)]
    return model_flops(cfg, rows, cols) + sum(rows * (after[layer] + head) for layer, _ in unit_keys(cfg))


def calibration_line(cfg: ModelConfig, rows: int, cols: int, settings: CalibrationSettings) -> str:
    """What a calibration about to run will take: its rows and, where a rate was measured, about how long
    (the unit KL probe included; `unit_kl_line` states its share again as it starts)."""
    text = f"calibrate: {rows:,} rows x {cols:,} tokens"
    rate = CalibrationRate.load(settings.device)
    if rate is None:
        return text + f" (no measured calibration rate for --device {settings.device}, so no time estimate)"
    seconds = rate.seconds(calibration_flops(cfg, rows, cols, settings))
    return text + (f", about {_duration(seconds)} at the rate measured on {rate.device} (bench/calibrate_cpu.py); "
                   "--calib-rows sets the rows")


def unit_kl_line(cfg: ModelConfig, rows: int, cols: int, device: str) -> str:
    """Before the unit KL probe: what it measures and, where a rate was measured, about how long."""
    text = f"calibrate: unit KL of {len(unit_keys(cfg))} layer units on {rows:,} x {cols:,} tokens"
    rate = CalibrationRate.load(device)
    if rate is None:
        return text + f"; no measured calibration rate for --device {device}, so no time estimate"
    seconds = probe_flops(cfg, rows, cols) / rate.probe_flops_per_s
    return text + f", about {_duration(seconds)} at the rate measured on {rate.device} (bench/calibrate_cpu.py)"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
