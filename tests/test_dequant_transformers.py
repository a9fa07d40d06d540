"""Our FP8/FP4 dequantization agrees with transformers 5.23's, on every quantized tensor of tiny
checkpoints of both architectures (V4: 128x128 grids; V4.1: 32x32; experts: MXFP4 1x32; Engram rows)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from quantizer.checkpoint.dequant import quantize_fp8_blocks, quantize_mxfp4, unpack_fp4
from quantizer.checkpoint.source import Checkpoint


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_every_quantized_tensor_matches_transformers(arch, tiny_v4, tiny_v41):
    ck = Checkpoint.open(tiny_v4 if arch == "v4" else tiny_v41)
    reference = Fp8Dequantize(None)
    checked = 0
    for name in ck.tensors:
        scale = ck.scale_name(name)
        if scale is None:
            continue
        ours = ck.weight(name)
        theirs = reference._dequantize_one(ck.raw(name), ck.raw(scale), output_dtype=torch.float32)
        assert torch.equal(ours, theirs), name
        checked += 1
    assert checked > 250


def test_fp4_nibble_order_and_sign():
    packed = torch.tensor([[0x1F, 0x8A]], dtype=torch.uint8).view(torch.int8)
    # byte 0x1F: low nibble F = -6, high nibble 1 = 0.5; byte 0x8A: low A = -1, high 8 = -0
    assert unpack_fp4(packed).tolist() == [[-6.0, 0.5, -1.0, -0.0]]


def test_native_quantizers_round_trip_within_format_error():
    x = torch.randn(64, 256)
    w, s = quantize_mxfp4(x)
    back = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32)
    assert (back - x).norm() / x.norm() < 0.15
    w8, s8 = quantize_fp8_blocks(x, (32, 32))
    back8 = Fp8Dequantize(None)._dequantize_one(w8, s8, output_dtype=torch.float32)
    assert (back8 - x).norm() / x.norm() < 0.04
