"""The EXL3 vocabulary every stage shares: codebooks, rates, what a linear stores, its bytes, alignment.

Also the rate-distortion table the allocator starts from. The facts are in docs/exl3-format.md. This
package imports no stage (only quantizer.errors), so the codec, calibrate, plan, fit, quantize, pack
and verify all read the same rules from one place.
"""

from quantizer.exl3.codebook import CODEBOOKS, NUM_STATES, Codebook, codebook_values, parse_codebook
from quantizer.exl3.distortion import CODEBOOK_MSE_FACTOR, MUL1_MSE, model_proxy
from quantizer.exl3.k_values import (
    HALF_RATES,
    INTEGER_RATES,
    UNQUANTIZED,
    check_bpw,
    check_k,
    drafter_k,
    k_words,
    rate_floor,
    rate_grid,
    trellis_k,
)
from quantizer.exl3.sizes import (
    EXL3_LEAVES,
    EXL3_QUANTIZED_LEAVES,
    HADAMARD_BLOCK,
    PACK_ALIGN,
    budget_bpw,
    exl3_bytes,
    k_from_trellis,
    leaf_layout,
)

__all__ = [
    "CODEBOOKS", "CODEBOOK_MSE_FACTOR", "EXL3_LEAVES", "EXL3_QUANTIZED_LEAVES", "HADAMARD_BLOCK", "HALF_RATES",
    "INTEGER_RATES", "MUL1_MSE", "NUM_STATES", "PACK_ALIGN", "UNQUANTIZED", "Codebook", "budget_bpw", "check_bpw",
    "check_k", "codebook_values", "drafter_k", "exl3_bytes", "k_from_trellis", "k_words", "leaf_layout", "model_proxy",
    "parse_codebook", "rate_floor", "rate_grid", "trellis_k",
]
