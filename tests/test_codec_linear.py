"""quantize_linear (exllamav3's algorithm on the CPU encoder) and the stored tensor dict."""

import pytest
import torch

from quantizer.codec import EXL3Linear, dequantize, quantize_linear
from quantizer.errors import UserError
from quantizer.exl3 import Codebook


def _layer(out_f: int, in_f: int, seed: int = 0):
    """A weight with uneven channel scales and a correlated, uneven-variance input Hessian."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * (0.5 + torch.rand(out_f, 1, generator=g)) * 0.02
    mix = torch.eye(in_f) + 0.5 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
    x = torch.randn(1024, in_f, generator=g) * (0.2 + 2 * torch.rand(in_f, generator=g)) @ mix
    return w, x.T @ x, x.shape[0]


def _h_error(w, q, h) -> float:
    e = w - dequantize(q)
    return (((e @ h) * e).sum() / ((w @ h) * w).sum()).item()


@pytest.fixture(scope="module")
def layer():
    return _layer(128, 128)


@pytest.fixture(scope="module")
def by_k(layer):
    w, h, count = layer
    return {k: quantize_linear(w, k, h, count) for k in (2, 3, 4)}


def test_result_shapes_and_types(by_k):
    q = by_k[3]
    assert q.trellis.dtype == torch.int16 and q.trellis.shape == (128 // 16, 128 // 16, 48)
    assert q.suh.dtype == torch.float16 and q.suh.shape == (128,)
    assert q.svh.dtype == torch.float16 and q.svh.shape == (128,)
    assert q.codebook is Codebook.MUL1 and q.K == 3 and q.in_features == 128 and q.out_features == 128


def test_proxy_error_is_what_is_stored_and_falls_with_k(layer, by_k):
    w, h, count = layer
    errs = [by_k[k].proxy_err for k in (2, 3, 4)]
    for k, err in zip((2, 3, 4), errs):
        assert err == pytest.approx(_h_error(w, by_k[k], h / count), rel=1e-4)
    # Each bit buys about a factor of four (Gaussian rate-distortion); LDLQ does better than plain MSE.
    assert 0.0 < errs[2] < errs[1] < errs[0] < 0.075
    assert errs[0] / errs[1] > 3 and errs[1] / errs[2] > 3


def test_hessian_aware_beats_plain_mse_in_the_h_metric(layer, by_k):
    w, h, count = layer
    plain = quantize_linear(w, 2)
    assert plain.proxy_err == pytest.approx(((w - dequantize(plain)).square().sum() / w.square().sum()).item(),
                                            rel=1e-4)
    assert plain.proxy_err < 0.08
    assert by_k[2].proxy_err < 0.8 * _h_error(w, plain, h / count)


def test_seed_decides_the_signs(layer, by_k):
    w, h, count = layer
    same, other = (quantize_linear(w, 4, h, count, seed=s) for s in (0, 1))
    assert torch.equal(same.trellis, by_k[4].trellis) and torch.equal(same.suh, by_k[4].suh)
    assert not torch.equal(other.suh.sign(), same.suh.sign())


def test_dead_output_channels_stay_exactly_zero(layer):
    w, h, count = layer
    w = w.clone()
    w[::3] = 0.0
    out = dequantize(quantize_linear(w, 3, h, count))
    assert torch.equal(out[::3], torch.zeros_like(out[::3])) and out[1::3].abs().sum() > 0


def test_degenerate_hessian_falls_back_to_plain_mse(layer):
    w, _, _ = layer
    with pytest.warns(UserWarning, match="plain MSE"):
        q = quantize_linear(w, 4, torch.zeros(128, 128))
    # Without a usable H the proxy error is the plain relative MSE of what is stored.
    assert q.proxy_err == pytest.approx(((w - dequantize(q)).square().sum() / w.square().sum()).item(), rel=1e-4)
    assert q.proxy_err < 0.006


@pytest.mark.parametrize("codebook,marker", [("mul1", 0x83DCD12D - (1 << 32)), ("mcg", 0xCBAC1FED - (1 << 32)),
                                             ("3inst", None)])
def test_tensor_dict_round_trip(codebook, marker):
    g = torch.Generator().manual_seed(4)
    k = 2.5 if codebook == "mul1" else 2
    trellis = torch.randint(-(1 << 15), 1 << 15, (8, 16, int(16 * k)), generator=g, dtype=torch.int16)
    q = EXL3Linear(trellis, torch.rand(128, generator=g).half(), torch.rand(256, generator=g).half(), codebook, k, 0.1)
    d = q.tensors("layers.0.ffn.w1")
    assert set(d) == {f"layers.0.ffn.w1.{n}" for n in ("trellis", "suh", "svh")} | (
        {f"layers.0.ffn.w1.{codebook}"} if marker else set())
    if marker:
        m = d[f"layers.0.ffn.w1.{codebook}"]
        assert m.dtype == torch.int32 and m.shape == () and m.item() == marker
    back = EXL3Linear.from_tensors(d, "layers.0.ffn.w1")
    assert back.K == k and back.codebook == q.codebook and back.proxy_err is None
    assert torch.equal(back.trellis, trellis) and torch.equal(back.suh, q.suh) and torch.equal(back.svh, q.svh)


def test_from_tensors_refuses_incomplete_or_ambiguous_storage():
    q = EXL3Linear(torch.zeros(8, 8, 32, dtype=torch.int16), torch.ones(128).half(), torch.ones(128).half(),
                   "mul1", 2)
    d = q.tensors("x")
    with pytest.raises(ValueError, match="x.svh missing"):
        EXL3Linear.from_tensors({k: v for k, v in d.items() if k != "x.svh"}, "x")
    with pytest.raises(ValueError, match="both"):
        EXL3Linear.from_tensors({**d, "x.mcg": d["x.mul1"]}, "x")
    with pytest.raises(UserError, match="half rates are mul1-only"):
        EXL3Linear(torch.zeros(8, 8, 40, dtype=torch.int16), q.suh, q.svh, "3inst", 2.5)
    with pytest.raises(ValueError, match="svh must be fp16"):
        EXL3Linear(q.trellis, q.suh, q.svh.float(), "mul1", 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(weight=torch.zeros(100, 128)), "multiples of 128"),
    (dict(weight=torch.zeros(128, 200)), "multiples of 128"),
    (dict(weight=torch.zeros(128)), "2-D"),
    (dict(weight=torch.full((128, 128), float("inf"))), "NaN or inf"),
    (dict(mode="slow"), "encoder mode"),
    (dict(hessian=torch.eye(64)), r"Hessian must be \(128, 128\)"),
    (dict(hessian=torch.eye(128), count=-1), "count"),
])
def test_bad_input_gets_a_clear_error(kwargs, message):
    args = dict(weight=torch.zeros(128, 128), K=2) | kwargs
    with pytest.raises(ValueError, match=message):
        quantize_linear(**args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(K=0), "not an EXL3 rate"),
    (dict(K=9), "not an EXL3 rate"),
    (dict(K=2.25), "not an EXL3 rate"),
    (dict(K="two"), "not a number"),
    (dict(K=1.5, codebook="mcg"), "mul1"),
    (dict(codebook="int4"), "unknown EXL3 codebook"),
])
def test_a_bad_rate_or_codebook_is_a_user_error(kwargs, message):
    # K and the codebook come from plans, recipes and flags: one UserError line, as everywhere else
    args = dict(weight=torch.zeros(128, 128), K=2) | kwargs
    with pytest.raises(UserError, match=message):
        quantize_linear(**args)
