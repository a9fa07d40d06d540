"""quantizer/codec/exllamav3_batch.py without a GPU: the block LDL factor it makes, and the inputs it hands to
exllamav3 whole. Its stored tensors against exllamav3's are compared in tests/gpu/test_encoder_kernel.py."""

from __future__ import annotations

import torch

from quantizer.codec.exllamav3_batch import BLOCK, _takes, _unit_blocks


def test_unit_blocks_turn_a_cholesky_factor_into_ldlq_s_block_factor():
    """H = (I + L) D (I + L)^T with D block-diagonal (16 x 16 blocks) and L strictly lower by blocks: LDLQ's
    error feedback reads L (zero diagonal blocks), and the factorization must give H back."""
    n = 4 * BLOCK
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    H = x.T @ x
    chol = torch.linalg.cholesky(H).contiguous()
    L = chol.clone()
    _unit_blocks(L)
    m = n // BLOCK
    blocks = L.view(m, BLOCK, m, BLOCK).permute(0, 2, 1, 3)
    for i in range(m):
        assert torch.equal(blocks[i, i], torch.zeros(BLOCK, BLOCK, dtype=L.dtype))
        for j in range(i + 1, m):
            assert torch.equal(blocks[i, j], torch.zeros(BLOCK, BLOCK, dtype=L.dtype))
    d = torch.block_diag(*[chol[i * BLOCK:(i + 1) * BLOCK, i * BLOCK:(i + 1) * BLOCK] for i in range(m)])
    unit = torch.eye(n, dtype=L.dtype) + L
    assert torch.allclose(unit @ (d @ d.T) @ unit.T, H, rtol=1e-9, atol=1e-8)


def _h_data(h, count=8, **extra):
    return {"H": h, "packed": False, "finalized": False, "count": count, **extra}


def _qa(devices=(0,), **extra):
    return {"K": 3, "devices": list(devices), "seed": 0, "mul1": True, **extra}


def test_what_the_loop_does_not_run_goes_to_exllamav3():
    """Dense calibrated Hessians on the device are run here; an uncalibrated (meta) Hessian, a count of 0, a
    Hessian elsewhere, in float64, finalized or packed, several devices or scaled Hessians go to
    quantize_exl3_batch."""
    cpu = torch.device("cpu")
    h = torch.eye(32)
    assert _takes([_h_data(h), _h_data(h)], [_qa(), _qa()], cpu)
    refused = [
        ([_h_data(torch.zeros(32, 32, device="meta"))], [_qa()]),
        ([_h_data(h, count=0)], [_qa()]),
        ([_h_data(h.double())], [_qa()]),
        ([_h_data(h, finalized=True)], [_qa()]),
        ([_h_data(h, packed=True)], [_qa()]),
        ([_h_data(h), _h_data(h)], [_qa(), _qa(devices=(1,))]),
        ([_h_data(h)], [_qa(devices=(0, 1))]),
        ([_h_data(h)], [_qa(scaled_hessian=True)]),
    ]
    for h_datas, qas in refused:
        assert not _takes(h_datas, qas, cpu)
