"""What a calibration run is told, beyond its source and token rows. A resumed run must match it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from quantizer.errors import UserError

DEVICES = ("cpu", "cuda")
EXPERT_HESSIAN_DTYPES = ("float16", "float32")
# How a routed expert's Hessians weight its tokens: the power of the routing weight g each routed token's
# x x^T is multiplied by, and whether the expert's gate/up projections get their own H (docs/calibration.md).
# shared: gate/up share the layer's all-token MoE-input H (exllamav3's capture); down weights by g^2.
# gate2 (the default): gate/up get their own H from the expert's routed tokens, weighted by g^2 like down.
EXPERT_HESSIANS = {"shared": 2, "gate2": 2, "gate": 1, "count": 0}
CHUNK_TOKENS = 16384  # tokens per row chunk pushed through a block together, by default
# The calibration text `calibrate` and `build` take by default: exllamav3's, 250 rows x 2048 tokens.
DEFAULT_ROWS, DEFAULT_COLS = 250, 2048


@dataclass(frozen=True)
class CalibrationSettings:
    """device: cpu (float32 model) or cuda (bfloat16 model); Hessians always accumulate in float32.
    all_experts: every token also runs through every routed expert (exllamav3's capture mode) so each
        expert's down projection gets an all-token prior; off: the prior comes from `sample_tokens`
        tokens of the layer's MoE input pushed through each expert after the layer ran (cheaper).
    prior_tokens: the weight of that prior in a routed down projection's H, in routed tokens:
        H_e = (sum_routed w^2 h h^T + prior_tokens * w2 * mean_all(h h^T)) / (sum_routed w^2 + prior_tokens * w2),
        with w the routing weight and w2 the layer's mean squared routing weight (w^p and its mean for the
        power p of expert_hessians). 0 = routed tokens only (an expert calibration never reaches then has
        no H); large = exllamav3's all-token H.
    row_chunk: rows pushed through a block together (None: CHUNK_TOKENS // cols).
    expert_hessian_dtype: storage of the routed experts' down-projection correlations (float16 halves
        the largest part of the disk; every other H is stored in float32).
    expert_hessians: a name of EXPERT_HESSIANS. gate2 (the default) / gate / count: a routed expert's
        gate/up and down projections get their own H from the expert's routed tokens weighted by g^2 / g
        / 1, each with the prior (for gate/up: prior_tokens times the layer's mean weight of the
        all-token MoE-input H), so an expert no token reached still gets a usable H. shared: its gate
        and up projections read the layer's all-token MoE-input H (exllamav3's), its down projection the
        g^2-weighted routed tokens plus the prior; a fifth of gate2's disk at real scale
        (docs/calibration.md, Cost).
    cold_share, max_cold_fraction: an expert routed less than cold_share x the layer's mean is cold,
        at most max_cold_fraction of the layer's experts (the coldest first); cold experts get an alias
        candidate (the most similar warm expert of the layer).
    alias_tokens: routed MoE inputs kept per expert to measure that similarity; alias_min_tokens: with
        fewer, it is measured on alias_tokens evenly spaced tokens of all the layer's MoE input instead.
    sample_tokens: evenly spaced MoE inputs kept per layer (the sampled prior; the alias fallback).
    measure_kl: measure each layer unit's KL by noise injection (unit_kl.py) on kl_rows evenly spaced
        calibration rows, their first kl_cols tokens; None: when the dequantized model fits in memory
        (small models), True: required (an error where it does not fit), False: never.
    """

    device: str = "cpu"
    all_experts: bool = True
    prior_tokens: float = 512.0
    row_chunk: int | None = None
    expert_hessian_dtype: str = "float16"
    expert_hessians: str = "gate2"
    cold_share: float = 0.25
    max_cold_fraction: float = 0.25
    alias_tokens: int = 128
    alias_min_tokens: int = 16
    sample_tokens: int = 4096
    measure_kl: bool | None = None
    kl_rows: int = 8
    kl_cols: int = 512

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device!r}; choose {' or '.join(DEVICES)}")
        if self.expert_hessian_dtype not in EXPERT_HESSIAN_DTYPES:
            raise UserError(f"--expert-hessian-dtype {self.expert_hessian_dtype!r}; choose "
                            f"{' or '.join(EXPERT_HESSIAN_DTYPES)}")
        if self.expert_hessians not in EXPERT_HESSIANS:
            raise UserError(f"--expert-hessians {self.expert_hessians!r}: unknown; choose one of "
                            f"{', '.join(EXPERT_HESSIANS)}")
        if self.prior_tokens < 0:
            raise UserError(f"--prior-tokens {self.prior_tokens:g}: must be 0 or more")
        if self.row_chunk is not None and self.row_chunk < 1:
            raise UserError(f"--row-chunk {self.row_chunk}: must be at least 1")
        if not (0 <= self.cold_share and 0 <= self.max_cold_fraction <= 1):
            raise UserError("cold_share must be >= 0 and max_cold_fraction within [0, 1]")
        if min(self.alias_tokens, self.alias_min_tokens, self.sample_tokens) < 1:
            raise UserError("alias_tokens, alias_min_tokens and sample_tokens must be at least 1")
        if min(self.kl_rows, self.kl_cols) < 1:
            raise UserError(f"--kl-rows {self.kl_rows} --kl-cols {self.kl_cols}: both must be at least 1")

    @property
    def gate_power(self) -> int:
        """The power of the routing weight each routed token's contribution is weighted by."""
        return EXPERT_HESSIANS[self.expert_hessians]

    @property
    def expert_inputs(self) -> bool:
        """Whether each routed expert's gate/up projections get their own H (not the layer's shared one)."""
        return self.expert_hessians != "shared"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def chunk_rows(self, rows: int, cols: int) -> int:
        return min(rows, self.row_chunk or max(1, CHUNK_TOKENS // cols))

    def record(self) -> dict:
        return asdict(self)
