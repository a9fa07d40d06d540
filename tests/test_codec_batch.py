"""quantize_linears: a batch of same-shape weights goes through the encoder together and gives what
quantize_linear gives per matrix, up to the shared global scale; LDLQ of a batch is per-matrix LDLQ; the
bounded scale-search sample finds the same scale as the whole matrix."""

import pytest
import torch

from quantizer.codec import EXL3Linear, dequantize, quantize_linear, quantize_linears, scale
from quantizer.codec.ldlq import block_ldl, finalize_hessian, ldlq
from quantizer.exl3 import Codebook


def _layer(out_f: int, in_f: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * (0.5 + torch.rand(out_f, 1, generator=g)) * 0.02
    mix = torch.eye(in_f) + 0.5 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
    x = torch.randn(512, in_f, generator=g) * (0.2 + 2 * torch.rand(in_f, generator=g)) @ mix
    return w, (x.T @ x, x.shape[0])


@pytest.fixture(scope="module")
def layers():
    return [_layer(128, 128, seed) for seed in range(4)]


@pytest.fixture(scope="module")
def batch_and_singles(layers):
    weights, hessians = [w for w, _ in layers], [h for _, h in layers]
    batch = quantize_linears(weights, 3, hessians, seeds=[10, 11, 12, 13])
    singles = [quantize_linear(w, 3, h, c, seed=10 + i) for i, (w, (h, c)) in enumerate(layers)]
    return batch, singles


def test_batch_has_the_per_matrix_format_and_signs(batch_and_singles):
    batch, singles = batch_and_singles
    for b, s in zip(batch, singles):
        assert isinstance(b, EXL3Linear) and b.codebook is s.codebook and b.K == s.K
        for name in ("trellis", "suh", "svh"):
            tb, ts = getattr(b, name), getattr(s, name)
            assert tb.dtype == ts.dtype and tb.shape == ts.shape, name
        assert torch.equal(b.suh.sign(), s.suh.sign()) and torch.equal(b.svh.sign(), s.svh.sign())


def test_batch_quality_equals_per_matrix_quality(layers, batch_and_singles):
    batch, singles = batch_and_singles
    for (w, (h, c)), b in zip(layers, batch):  # proxy_err is what the stored tensors give
        e = w - dequantize(b)
        assert b.proxy_err == pytest.approx((((e @ h) * e).sum() / ((w @ h) * w).sum()).item(), rel=1e-4)
    mean_batch = sum(q.proxy_err for q in batch) / len(batch)
    mean_single = sum(q.proxy_err for q in singles) / len(singles)
    assert mean_batch == pytest.approx(mean_single, rel=0.03)


def test_a_batch_of_one_is_quantize_linear(layers):
    w, (h, c) = layers[0]
    (b,) = quantize_linears([w], 2, [(h, c)], seeds=[7])
    s = quantize_linear(w, 2, h, c, seed=7)
    assert torch.equal(b.trellis, s.trellis) and torch.equal(b.suh, s.suh) and torch.equal(b.svh, s.svh)
    assert b.proxy_err == s.proxy_err


def test_shared_hessian_and_seed_forms(layers):
    weights = [w for w, _ in layers[:2]]
    h, c = layers[0][1]
    shared = quantize_linears(weights, 2, (h, c), seeds=5)
    listed = quantize_linears(weights, 2, [(h, c), (h, c)], seeds=[5, 6])
    for a, b in zip(shared, listed):
        assert torch.equal(a.trellis, b.trellis) and torch.equal(a.suh, b.suh) and torch.equal(a.svh, b.svh)


def test_ldlq_of_a_batch_is_per_matrix_ldlq(layers):
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(3, 128, 128, generator=g)
    lowers = [block_ldl(finalize_hessian(layers[0][1][0], 512)), None, block_ldl(finalize_hessian(layers[1][1][0], 512))]
    recon, states = ldlq(weights, lowers, 2, Codebook.MUL1, "fast")
    for m in range(3):
        r, s = ldlq(weights[m : m + 1], lowers[m : m + 1], 2, Codebook.MUL1, "fast")
        assert torch.equal(states[m], s[0]) and torch.equal(recon[m], r[0])
    # Without a Hessian LDLQ is plain per-tile quantization, strip by strip or all at once.
    r_plain, s_plain = ldlq(weights[1:2], [None], 2, Codebook.MUL1, "fast")
    assert torch.equal(states[1], s_plain[0])


def test_sample_budget_is_bounded():
    assert scale.sample_budget(64) == 16  # one 128x128 matrix: 16 tiles (the old search encoded ~340)
    assert scale.sample_budget(256) == 32
    assert scale.sample_budget(8 * 64) == 64
    assert scale.sample_budget(10**6) == scale.SAMPLE_CAP
    assert scale.sample_budget(8) == 8
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2))
    tiles, shares = scale.sample_tiles(w, 24)
    assert tiles.shape == (24, 256) and shares.shape == (24,)
    assert shares.sum().item() == pytest.approx(1.0)  # the sample stands for the whole matrix


@pytest.mark.parametrize("K", [2, 4])
def test_bounded_sample_finds_the_whole_matrix_scale(K, monkeypatch):
    g = torch.Generator().manual_seed(K)
    w = torch.randn(128, 256, generator=g) * (1 + 2 * (torch.rand(128, 1, generator=g) > 0.9))  # outlier rows
    bounded = scale.global_scale([w], K, Codebook.MUL1)
    monkeypatch.setattr(scale, "sample_budget", lambda tiles: tiles)  # every tile of the matrix
    whole = scale.global_scale([w], K, Codebook.MUL1)
    tiles, shares = scale.sample_tiles(w, 128)
    err = scale._sample_mse(tiles, shares, [bounded, whole], K, Codebook.MUL1)
    assert err[0] <= 1.01 * err[1]


def test_batch_input_errors(layers):
    w, (h, c) = layers[0]
    with pytest.raises(ValueError, match="same-shape"):
        quantize_linears([w, torch.zeros(256, 128)], 2)
    with pytest.raises(ValueError, match="2 weights need 2 seeds"):
        quantize_linears([w, w], 2, seeds=[1])
    with pytest.raises(ValueError, match=r"\(H, count\) pairs"):
        quantize_linears([w, w], 2, [(h, c)])
    with pytest.raises(ValueError, match="at least one"):
        quantize_linears([], 2)
