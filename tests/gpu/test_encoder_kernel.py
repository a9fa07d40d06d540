"""Our CUDA tile encoder (quantizer/codec/kernel) writes exactly exllamav3 1.6.5's codes.

For every integer K and codebook the kernel does, the states and the reconstructed values must be
torch.equal to exllamav3's `quantize_tiles` on the same tiles: random N(0,1) tiles (more tiles than the
GPU has SMs, so blocks take several tiles each), scaled tiles (up to costs that overflow to inf), all-zero
tiles, constant tiles, "coarse" tiles (|w| about 13, where fp16 path costs are so coarse that many candidates
tie exactly and only the same first-index rule gives the same codes), and tiles made of codebook values
(exllamav3's own reconstruction fed back). Non-finite input is refused in one line. And the conversion the
quantize stage runs stores the same tensors with our kernel in place of exllamav3's.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU with exllamav3 1.6.5", allow_module_level=True)
pytest.importorskip("exllamav3")

from quantizer.codec import kernel  # noqa: E402

CODEBOOKS = {"3inst": {}, "mcg": {"mcg": True}, "mul1": {"mul1": True}}


def theirs(tiles: torch.Tensor, K: int, codebook: str):
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_tiles

    return quantize_tiles(tiles, {"K": K, **CODEBOOKS[codebook]})


def tile_set(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    random = torch.randn(2 * sms + 7, 256, generator=g)
    scaled = torch.randn(8, 256, generator=g) * torch.tensor([0.01, 0.1, 3.0, 10.0, 100.0, 1e3, 3e3, 1e4])[:, None]
    constant = torch.tensor([0.0, 0.0, 1.0, -1.5, 0.25, 7.0])[:, None].expand(6, 256)
    # |w| about 13: path costs where an fp16 step is 16-32, so many candidates tie exactly (the first-index rule)
    signs = torch.randint(0, 2, (8, 256), generator=g) * 2.0 - 1.0
    coarse = (13.0 + 0.5 * torch.randn(8, 256, generator=g)) * signs
    return torch.cat([random, scaled, constant, coarse]).cuda()


@pytest.fixture(scope="module")
def built():
    if why := kernel.unavailable_reason():
        pytest.fail(f"our kernel did not build on a CUDA machine: {why}")


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("K", kernel.KS)
def test_codes_equal_exllamav3(built, K, codebook):
    tiles = tile_set(1000 + K)
    ref_values, ref_states = theirs(tiles, K, codebook)
    values, states = kernel.encode_tiles(tiles, K, kernel.CODEBOOKS[codebook])
    differ = (states != ref_states).any(dim=1)
    first = differ.nonzero()[:5].flatten().tolist()
    assert torch.equal(states, ref_states), f"{int(differ.sum())} of {len(tiles)} tiles differ, first {first}"
    assert torch.equal(values, ref_values)

    # Codebook values as input: zero-cost paths, many ties
    on_codebook = torch.cat([ref_values[:64], values[-6:]])
    ref_values2, ref_states2 = theirs(on_codebook, K, codebook)
    values2, states2 = kernel.encode_tiles(on_codebook, K, kernel.CODEBOOKS[codebook])
    assert torch.equal(states2, ref_states2)
    assert torch.equal(values2, ref_values2)


def test_quantize_tiles_takes_exllamav3_arguments(built):
    """The drop-in: exllamav3's argument dict in, its outputs out, ours where it runs; exllamav3's own
    encoder at half-integer K (said once on stderr)."""
    tiles = tile_set(7)[:40]
    for qa in ({"K": 3, "mul1": True}, {"K": 2, "mcg": True}):
        out = kernel.quantize_tiles(tiles, qa)
        ref = theirs(tiles, qa["K"], "mul1" if qa.get("mul1") else "mcg")
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert kernel.fallback_reason(tiles, {"K": 2.5, "mul1": True}).startswith("K 2.5 is half-integer")
    assert kernel.fallback_reason(tiles, {"K": 8, "mul1": True}).startswith("K 8 is outside")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_refused(built, bad):
    tiles = torch.zeros(3, 256, device="cuda")
    tiles[1, 17] = bad
    with pytest.raises(ValueError, match="^tiles contain NaN or inf$"):
        kernel.encode_tiles(tiles, 2, kernel.CODEBOOKS["mul1"])


def test_wrong_shape_or_k_refused(built):
    with pytest.raises(ValueError, match="K 7"):
        kernel.encode_tiles(torch.zeros(1, 256, device="cuda"), 7, 2)
    with pytest.raises(ValueError, match=r"\(N, 256\)"):
        kernel.encode_tiles(torch.zeros(1, 160, device="cuda"), 2, 2)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 2.5])
def test_exllamav3_conversion_with_our_kernel_stores_the_same_tensors(built, K):
    """What the quantize stage runs (quantize_batch: exllamav3's conversion, LDLQ and scale search
    included) on two routed-expert w1 of V4.1's shape with a Hessian each: every stored tensor and the proxy
    error equal with our kernel and with exllamav3's (K 2.5 takes exllamav3's own path either way)."""
    from quantizer.codec.exllamav3_adapter import quantize_batch

    g = torch.Generator(device="cuda").manual_seed(int(K * 10))
    weights = [0.02 * torch.randn(2304, 5120, device="cuda", generator=g) for _ in range(2)]
    rows = [torch.randn(6144, 5120, device="cuda", generator=g) for _ in range(2)]
    hessians = [x.T @ x for x in rows]
    out = {how: quantize_batch(weights, K, hessians, counts=[6144, 6144], seed=5, tile_search=how)
           for how in ("exllamav3", "ours")}
    for theirs, ours in zip(out["exllamav3"], out["ours"]):
        assert ours.proxy_err == theirs.proxy_err
        a, b = theirs.tensors("w"), ours.tensors("w")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
