"""EXL3 codec: exllamav3's trellis format, decoded bit-exactly and encoded on any torch device.

Public surface:
- EXL3Linear: one quantized linear (trellis, suh, svh, codebook, K, proxy_err) and its tensor dict.
- quantize_linear: HF weight (+ Hessian) -> EXL3Linear, exllamav3's algorithm on our own encoder.
- quantize_linears: the same for a batch of same-shape weights at one K (shared encoder calls, one scale search).
- dequantize / decode_rotated: the original-basis weight, or the rotated one exactly as exllamav3 builds it.
- encode_tiles / pack_trellis / unpack_trellis: the trellis encoder and the bit stream, for tooling and tests.
The CPU encoder is compiled C++ when a compiler is present (native.py), pure torch otherwise.
Codebooks, rates and sizes are quantizer.exl3's (the shared EXL3 vocabulary).
exllamav3 itself is only touched by quantizer.codec.exllamav3_adapter (GPU machines).
"""

from .decode import decode_rotated, dequantize
from .linear import quantize_linear, quantize_linears
from .packed import EXL3Linear
from .trellis import pack_trellis, unpack_trellis
from .viterbi import EncoderMode, encode_tiles

__all__ = [
    "EXL3Linear",
    "EncoderMode",
    "decode_rotated",
    "dequantize",
    "encode_tiles",
    "pack_trellis",
    "quantize_linear",
    "quantize_linears",
    "unpack_trellis",
]
