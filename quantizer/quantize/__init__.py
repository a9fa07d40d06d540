"""The quantize stage: a plan's EXL3 linears encoded into a resumable work directory."""

from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import HessianProvider, QuantizeResult, quantize

__all__ = ["HessianProvider", "QuantizeResult", "QuantizeSettings", "quantize"]
