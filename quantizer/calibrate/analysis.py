"""The per-tensor numbers the allocator reads, computed from a Hessian and (once) the weights.

out_energy(W, H) = tr(W H W^T) = E||W x||^2 per token under the mean H.

ldlq_factor(H): how much LDLQ lowers the quantization error against plain rounding of the same
weight. EXL3 quantizes in the Hadamard-rotated basis with a damped H (codec/ldlq.py). Write that H as
(I + L) D (I + L)^T with L strictly block-lower (16-row strips): LDLQ leaves an error tr(E^T D E), i.e.
~ sigma^2 tr(D) for a per-weight quantization noise sigma^2, where plain rounding leaves
tr(E^T H E) ~ sigma^2 tr(H). The factor is tr(D) / tr(H) = mean(D) / mean(diag H) <= 1 (1 for a
white H, small when inputs are strongly correlated). D's blocks are C_b C_b^T for the diagonal blocks
C_b of the Cholesky factor, so tr(D) is the squared Frobenius norm of those blocks.
"""

from __future__ import annotations

import torch

from quantizer.codec.hadamard import rotate_cols, rotate_rows
from quantizer.codec.ldlq import SIGMA_REG, finalize_hessian
from quantizer.codec.trellis import TILE

CHOLESKY_RETRIES = 10
ENERGY_ROWS = 8192  # weight rows per product in out_energy (bounds memory for the head)
SIGN_SEED = 0


def out_energy(weight: torch.Tensor, h: torch.Tensor) -> float:
    """tr(W H W^T) for W [out, in], H [in, in], in float32, a block of rows at a time."""
    h = h.float()
    total = 0.0
    for start in range(0, weight.shape[0], ENERGY_ROWS):
        w = weight[start:start + ENERGY_ROWS].float()
        total += float(((w @ h) * w).sum())
    return total


def ldlq_factor(h: torch.Tensor) -> float:
    """tr(D) / tr(H) of the damped, sign-flipped, Hadamard-rotated mean H (module docstring); 1.0
    when H is unusable (LDLQ is then not applied: plain rounding)."""
    damped = finalize_hessian(h, 1)
    if damped is None:
        return 1.0
    n = damped.shape[0]
    gen = torch.Generator().manual_seed(SIGN_SEED)
    signs = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(damped)
    rotated = rotate_rows(rotate_cols(damped * signs.unsqueeze(0)) * signs.unsqueeze(1))
    for _ in range(CHOLESKY_RETRIES + 1):
        chol, info = torch.linalg.cholesky_ex(rotated)
        if info.item() == 0:
            break
        rotated.diagonal().add_(2 * SIGMA_REG * rotated.diagonal().mean())
    else:
        return 1.0
    m = n // TILE
    blocks = chol.view(m, TILE, m, TILE).diagonal(dim1=0, dim2=2)  # [TILE, TILE, m]
    return float(blocks.square().sum() / rotated.diagonal().sum())


def alias_errors(experts, cold: list[int], warm: list[int], inputs: list[torch.Tensor]) -> dict[int, tuple[int, float]]:
    """For each cold expert c (with its measurement tokens inputs[i], [n_i, D]): the warm expert w
    minimising ||E_c(x) - E_w(x)||^2 / ||E_c(x)||^2 summed over those tokens, and that ratio."""
    if not cold or not warm:
        return {}
    x = torch.cat(inputs)
    segment = torch.cat([torch.full((len(t),), i, device=x.device) for i, t in enumerate(inputs)])
    reference = torch.cat([experts[c](t).float() for c, t in zip(cold, inputs)])
    norms = torch.zeros(len(cold), dtype=torch.float64, device=x.device)
    norms.index_add_(0, segment, reference.square().sum(-1).double())
    errors = torch.empty(len(cold), len(warm), dtype=torch.float64, device=x.device)
    for j, w in enumerate(warm):
        diff = (experts[w](x).float() - reference).square().sum(-1).double()
        errors[:, j] = torch.zeros_like(norms).index_add_(0, segment, diff) / norms.clamp(min=1e-30)
    best = errors.argmin(dim=1)
    return {c: (warm[int(best[i])], float(errors[i, best[i]])) for i, c in enumerate(cold)}
