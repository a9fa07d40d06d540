"""How much error a trellis leaves at each rate: the relative MSE of each codebook on Gaussian data.

exllamav3's encoder, measured on i.i.d. N(0, 1) tiles with no LDLQ and no scale search
(docs/exl3-format.md, distortion). The allocator's proxy error per K starts from this table; unit-KL
calibration perturbs at its K 3 value.
"""

from __future__ import annotations

import numpy as np

# relative MSE of mul1 per K (K 7 is interpolated)
MUL1_MSE = {1.0: 0.277, 1.5: 0.137, 2.0: 0.068, 2.5: 0.035, 3.0: 0.0176, 3.5: 0.0090,
            4.0: 0.0046, 5.0: 0.0013, 6.0: 0.0004, 8.0: 0.0001}
# Same table, other codebooks: mcg measured 1.088x (K2) and 1.022x (K4) of mul1, 3INST 1.043x (K4).
CODEBOOK_MSE_FACTOR = {"mul1": 1.0, "mcg": float(np.sqrt(1.088 * 1.022)), "3inst": 1.043}


def model_proxy(rates: tuple[float, ...] | np.ndarray, codebook: str = "mul1") -> np.ndarray:
    """Relative MSE of the codebook at each rate: the measured table, log-linear between its points."""
    ks = np.array(sorted(MUL1_MSE))
    log_mse = np.log([MUL1_MSE[k] for k in ks])
    return np.exp(np.interp(np.asarray(rates, dtype=float), ks, log_mse)) * CODEBOOK_MSE_FACTOR[codebook]
