"""The GB10 fit calculator: per-rank memory of a pack (or a plan) on 1, 2 or 4 DGX Sparks."""

from quantizer.fit.hardware import Hardware, load_hardware
from quantizer.fit.memory import FitReport, RankMemory, fit, fit_table
from quantizer.fit.placement import block_split
from quantizer.fit.stored import StoredTensor, stored_from_pack

__all__ = [
    "FitReport", "Hardware", "RankMemory", "StoredTensor", "block_split", "fit", "fit_table",
    "load_hardware", "stored_from_pack",
]
