"""The quantize stage on CUDA gives back the GPU memory exllamav3's encoder keeps between calls.

Run on the GPU machine: `source .device-cache/setup.sh && python -m pytest tests/gpu/test_quantize_cuda.py -q`.
exllamav3 1.6.5 caches its trellis-search scratch per (device, K) for the life of the process: 5.3 GiB
allocated after a 2.5 bpw build of the small V4 model, 64 MiB once it is freed. Left there it is memory
the tune and pack stages, and the check of what they need, cannot see (docs/exl3-format.md, "Encoder
scratch").
"""

from __future__ import annotations

import pytest
import torch

from quantizer.orchestrate.stages import BuildRequest, build
from quantizer.quantize.settings import QuantizeSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and exllamav3")

LEFT_OVER = 256 * 2**20  # bytes a build may leave allocated (cuBLAS workspace, small tables); the scratch is GiB


def test_the_quantize_stage_leaves_no_encoder_scratch_on_the_gpu(tiny_v4, tmp_path):
    from exllamav3.modules.quant.exl3_lib import quantize as encoder

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = build(BuildRequest(str(tiny_v4), tmp_path / "pack", bpw=2.5, method="uniform",
                                quantize=QuantizeSettings(device="cuda")))
    assert not result.verify.faults, result.verify.render()
    assert result.quantized.resumed_units < result.quantized.units  # exllamav3 encoded here: its scratch was made
    torch.cuda.synchronize()
    assert encoder.get_temp_buffers.cache_info().currsize == 0
    assert encoder.get_temp_buffers_frac.cache_info().currsize == 0
    left = torch.cuda.memory_allocated() - before
    assert left < LEFT_OVER, f"{left / 2**20:.0f} MiB left allocated on the GPU after the build"
