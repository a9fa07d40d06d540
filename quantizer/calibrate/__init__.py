"""The calibrate stage: input Hessians, routing statistics and the allocator's summary of a native model.

Public surface:
- calibrate(ck, rows, work, settings) -> CalibrationResult: run (or resume) a calibration into WORK/calibration.
- CalibrationSettings: what a run is told (device, all-experts capture, prior weight, cold-expert thresholds).
- HessianStore(work, ck).hessian(key) -> (H summed over count tokens, count) | None: the quantize
  stage's HessianProvider (refuses an incomplete calibration or one of another checkpoint).
- calibration_needs(cfg, rows, cols, settings): memory and disk, before a run.
- CalibrationSummary, LayerStats, TensorStats: the summary the allocator reads (summary.py).
"""

from quantizer.calibrate.needs import CalibrationNeeds, calibration_needs
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.stage import CalibrationResult, calibrate
from quantizer.calibrate.storage import HessianStore
from quantizer.calibrate.summary import CalibrationSummary, LayerStats, TensorStats

__all__ = [
    "CalibrationNeeds",
    "CalibrationResult",
    "CalibrationSettings",
    "CalibrationSummary",
    "HessianStore",
    "LayerStats",
    "TensorStats",
    "calibrate",
    "calibration_needs",
]
