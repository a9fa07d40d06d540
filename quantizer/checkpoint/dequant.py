"""Native DeepSeek storage formats to real numbers, and back.

FP8 e4m3 weights carry a 2-D grid of E8M0 exponents (`.scale`, 2^(byte-127)); the block shape is
whatever tiles the weight (V4.1 32x32, V4 128x128, Engram rows 1x32). Routed experts are MXFP4:
two e2m1 codes per int8 byte, element 2j in the low nibble, one E8M0 per 32 inputs of a row.
"""

from __future__ import annotations

import torch

from quantizer.errors import UserError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to float32 powers of two; 255 is NaN by the OCP MX spec."""
    e = exponents.to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 scales to the E8M0 byte of the power of two at or above each."""
    e = torch.ceil(torch.log2(scale.float().clamp_min(2.0**-127))).to(torch.int32) + 127
    return e.clamp(0, 254).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[.., n/2] int8 bytes to [.., n] float32 e2m1 values (low nibble first)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return lut[codes]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[.., n] e2m1 codes (0..15) to [.., n/2] int8 bytes, element 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def scale_block(weight_shape: tuple[int, ...], grid_shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """The block (rows, cols) that a scale grid of `grid_shape` tiles a weight of `weight_shape` with.

    Blocks are powers of two (DeepSeek uses 128x128, 32x32 and 1x32); the last block may be partial.
    """
    if len(weight_shape) != 2 or len(grid_shape) != 2:
        raise UserError(f"{name}: scale grid {list(grid_shape)} does not fit weight {list(weight_shape)} (need 2-D)")
    block = []
    for dim, cells in zip(weight_shape, grid_shape):
        b = -(-dim // cells) if cells else 0
        if cells == 0 or b & (b - 1) or -(-dim // b) != cells:
            raise UserError(
                f"{name}: scale grid {list(grid_shape)} does not tile weight {list(weight_shape)}; "
                "the checkpoint is corrupt or mixes tensors of different models"
            )
        block.append(b)
    return block[0], block[1]


def apply_block_scale(values: torch.Tensor, exponents: torch.Tensor, name: str) -> torch.Tensor:
    """Multiply float32 `values` [out, in] by the E8M0 grid expanded over its blocks."""
    bo, bi = scale_block(tuple(values.shape), tuple(exponents.shape), name)
    s = e8m0_to_float(exponents)
    s = s.repeat_interleave(bo, 0)[: values.shape[0]].repeat_interleave(bi, 1)[:, : values.shape[1]]
    return values * s


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A stored tensor (+ its `.scale` grid, if any) as `dtype` on `device`.

    int8 weights with a scale are packed FP4; float8 weights are e4m3; anything else is returned as
    a plain cast (BF16, F32 and F16 to `dtype`; integer tensors such as I64 `tid2eid` unchanged).
    """
    weight = weight.to(device)
    if scale is None:
        if weight.dtype == torch.float8_e4m3fn:
            raise UserError(f"{name}: FP8 weight without a .scale tensor")
        if not weight.is_floating_point():
            return weight
        return weight.to(dtype)
    scale = scale.to(device)
    if scale.dtype != torch.uint8:
        raise UserError(f"{name}: scale has dtype {scale.dtype}, expected F8_E8M0")
    if weight.dtype == torch.int8:
        values = unpack_fp4(weight)
    elif weight.dtype == torch.float8_e4m3fn:
        values = weight.to(torch.float32)
    else:
        raise UserError(f"{name}: a .scale grid belongs to FP8 or FP4 weights, not {weight.dtype}")
    return apply_block_scale(values, scale, name).to(dtype)


FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp8_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] to (float8_e4m3fn, E8M0 grid) with one power-of-two scale per block, on x's device."""
    out, inp = x.shape
    bo, bi = block
    go, gi = -(-out // bo), -(-inp // bi)
    pad = torch.zeros(go * bo, gi * bi, dtype=torch.float32, device=x.device)
    pad[:out, :inp] = x.float()
    amax = pad.abs().reshape(go, bo, gi, bi).amax(dim=(1, 3))
    exps = float_to_e8m0(amax / 448.0)
    scale = e8m0_to_float(exps).repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    return (x.float() / scale).to(torch.float8_e4m3fn), exps


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] to (packed int8 [out, in/2], E8M0 [out, in/32]): MXFP4, round to nearest, on x's device."""
    out, inp = x.shape
    groups = x.float().reshape(out, inp // 32, 32)
    exps = float_to_e8m0(groups.abs().amax(dim=-1) / 6.0)
    scaled = groups / e8m0_to_float(exps).unsqueeze(-1)
    mags = (scaled.abs().unsqueeze(-1) - FP4_GRID.to(x.device)).abs().argmin(dim=-1)
    codes = mags + 8 * (scaled < 0).to(torch.int64) * (mags > 0).to(torch.int64)
    return pack_fp4(codes.reshape(out, inp)), exps
