"""The CPU codec against exllamav3 1.6.5 itself (GPU machine only).

Run from the repository root on the GPU machine:
    source .device-cache/setup.sh && python -m pytest tests/gpu/test_codec_exllamav3.py -q
With RECORD_FIXTURES=DIR it also writes the small safetensors fixtures (one per case, < 2 MiB in all)
that tests/test_codec_decode_exllamav3.py re-checks on CPU; they belong in tests/fixtures/codec/ (on the device
tool: RECORD_FIXTURES=$OUT/codec, then copy the files back there).
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU with exllamav3 1.6.5", allow_module_level=True)
pytest.importorskip("exllamav3")

from safetensors.torch import save_file  # noqa: E402

from quantizer.codec import (  # noqa: E402
    decode_rotated,
    dequantize,
    encode_tiles,
    pack_trellis,
    quantize_linear,
    unpack_trellis,
)
from quantizer.codec import exllamav3_adapter as exl3  # noqa: E402
from quantizer.exl3 import Codebook, codebook_values  # noqa: E402

RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8)
CASES = [(cb, k) for cb in ("mul1", "mcg", "3inst") for k in RATES if cb == "mul1" or float(k).is_integer()]
IN_FEATURES, OUT_FEATURES = 128, 256  # one small tensor per case: fixtures stay under 2 MiB in all
FIXTURE_BUDGET = 2 << 20
RECORD = os.environ.get("RECORD_FIXTURES")


def _weight(seed: int, out_f: int = OUT_FEATURES, in_f: int = IN_FEATURES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * (0.5 + torch.rand(out_f, 1, generator=g)) * 0.02


def _hessian(in_f: int, seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, in_f, generator=g) @ (torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=g) / in_f**0.5)
    return x.T @ x, x.shape[0]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float16 and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def _assert_original_basis_close(q):
    ref = exl3.reconstruct_weight(q).float().cpu()  # (in, out), fp16-rounded after each step by exllamav3
    ours = dequantize(q).T
    scale = ref.abs().max()
    assert torch.allclose(ours, ref, rtol=4e-3, atol=4e-3 * scale), (ours - ref).abs().max() / scale


@pytest.mark.parametrize("codebook,K", CASES, ids=[f"{cb}-K{k}" for cb, k in CASES])
def test_decoder_bit_exact_with_reconstruct(codebook, K):
    q = exl3.quantize(_weight(seed=int(10 * K)), K, codebook=codebook, seed=1)
    assert q.trellis.shape == (IN_FEATURES // 16, OUT_FEATURES // 16, int(16 * K)) and q.codebook is Codebook(codebook)
    ref = exl3.reconstruct_rotated(q)
    assert _same_bits(decode_rotated(q.trellis, K, codebook), ref)  # CPU
    assert _same_bits(decode_rotated(q.trellis.cuda(), K, codebook), ref)  # CUDA
    _assert_original_basis_close(q)
    if RECORD:
        out = Path(RECORD)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {**q.tensors("weight"), "reconstructed": ref.cpu()}
        save_file(tensors, out / f"{codebook}_k{K}.safetensors",
                  metadata={"K": str(K), "codebook": codebook, "source": "exllamav3 1.6.5 quantize_exl3 + reconstruct"})


@pytest.mark.parametrize("codebook,K", [("mul1", 2), ("mul1", 2.5), ("mcg", 4), ("3inst", 3)])
def test_calibrated_quantize_decodes_bit_exact(codebook, K):
    h, count = _hessian(IN_FEATURES, seed=3)
    q = exl3.quantize(_weight(seed=5), K, h, count=count, codebook=codebook, seed=2)
    assert 0.0 < q.proxy_err < 0.1
    assert _same_bits(decode_rotated(q.trellis, K, codebook), exl3.reconstruct_rotated(q))
    _assert_original_basis_close(q)


@pytest.mark.parametrize("codebook,K", [("mul1", 2), ("mul1", 3.5), ("mcg", 3), ("3inst", 4)])
def test_cpu_encoder_output_is_accepted_by_exllamav3(codebook, K):
    w = _weight(seed=7)
    h, count = _hessian(IN_FEATURES, seed=8)
    q = quantize_linear(w, K, h, count=count, codebook=codebook, mode="fast")
    linear = exl3.load_linear(q)
    assert _same_bits(linear.get_inner_weight_tensor(), decode_rotated(q.trellis, K, codebook))
    _assert_original_basis_close(q)
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(9)).half().cuda()
    expected = x.float() @ dequantize(q).T.cuda()
    scale = expected.abs().max()
    for params in ({}, {"reconstruct": True}):  # the GEMV kernel, then reconstruct + GEMM
        y = linear.forward(x, params).float()
        assert torch.allclose(y, expected, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("codebook,K", [("mul1", 1), ("mul1", 2), ("mul1", 2.5), ("mcg", 4), ("3inst", 4)])
def test_tile_encoder_matches_quantize_tiles(codebook, K):
    """Our exact encoder (on the GPU) against exllamav3's Viterbi kernel on the same Gaussian tiles: same
    distortion within 2 %, and both packers produce the same bits from exllamav3's states."""
    from exllamav3.modules.quant.exl3_lib.quantize import pack_trellis as exl3_pack
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_tiles

    tiles = torch.randn(1024, 256, generator=torch.Generator().manual_seed(11)).cuda()
    qa = {"K": K, "devices": [torch.cuda.current_device()], "mul1": codebook == "mul1", "mcg": codebook == "mcg"}
    ref_values, ref_states = quantize_tiles(tiles, qa)
    ours = encode_tiles(tiles, K, codebook, mode="exact")
    values = codebook_values(codebook, "cuda").float()[ours.long()]
    ref_mse = (ref_values - tiles).square().mean().item()
    our_mse = (values - tiles).square().mean().item()
    assert our_mse <= 1.02 * ref_mse, (our_mse, ref_mse)
    ref_packed = exl3_pack(ref_states.view(32, 32, 256), qa)
    assert torch.equal(pack_trellis(ref_states.view(32, 32, 256).int() & 0xFFFF, K), ref_packed)
    assert torch.equal(unpack_trellis(ref_packed, K), ref_states.view(32, 32, 256).int() & 0xFFFF)


def test_cpu_quantizer_tracks_exllamav3_proxy_error():
    """Same weight and Hessian through both quantizers (ours on the GPU here): similar proxy errors."""
    w = _weight(seed=12, out_f=256, in_f=256)
    h, count = _hessian(256, seed=13)
    for K in (2, 3):
        ref = exl3.quantize(w, K, h, count=count, seed=4)
        ours = quantize_linear(w.cuda(), K, h.cuda(), count=count, mode="exact", seed=4)
        assert 0.8 < ours.proxy_err / ref.proxy_err < 1.25, (K, ours.proxy_err, ref.proxy_err)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-H", "per-tensor-H"])
def test_quantize_batch(shared):
    ws = [_weight(seed=20 + i, out_f=256, in_f=128) for i in range(3)]
    hs = [_hessian(128, seed=30 + i) for i in range(3)]
    if shared:
        qs = exl3.quantize_batch(ws, 3, hs[0][0], counts=hs[0][1], seed=6)
    else:
        qs = exl3.quantize_batch(ws, 3, [h for h, _ in hs], counts=[c for _, c in hs], seed=6)
    assert len(qs) == 3
    for w, q in zip(ws, qs):
        assert q.K == 3 and 0.0 < q.proxy_err < 0.05
        assert _same_bits(decode_rotated(q.trellis, 3, "mul1"), exl3.reconstruct_rotated(q))
        rel = ((dequantize(q) - w).square().sum() / w.square().sum()).item()
        assert rel < 0.05


@pytest.mark.skipif(not RECORD, reason="only when recording fixtures (RECORD_FIXTURES=dir)")
def test_recorded_fixtures_cover_every_case_within_budget():
    files = sorted(Path(RECORD).glob("*.safetensors"))
    assert {f.stem for f in files} == {f"{cb}_k{k}" for cb, k in CASES}
    assert sum(f.stat().st_size for f in files) < FIXTURE_BUDGET
