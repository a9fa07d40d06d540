"""Our CUDA tile encoder (quantizer/codec/kernel) writes exactly exllamav3 1.6.5's codes.

For every integer K and codebook the kernel does, and the half rates 1.5, 2.5 and 3.5 (mul1), the states
and the reconstructed values must be torch.equal to exllamav3's `quantize_tiles` (its
`quantize_tiles_frac` at half rates) on the same tiles: random N(0,1) tiles (more tiles than the
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


def theirs(tiles: torch.Tensor, K: float, codebook: str):
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


RATES = [(K, cb) for K in kernel.KS if K not in kernel.HALF_RATES for cb in sorted(CODEBOOKS)]
RATES += [(K, "mul1") for K in kernel.HALF_RATES]


@pytest.mark.parametrize(("K", "codebook"), RATES)
def test_codes_equal_exllamav3(built, K, codebook):
    tiles = tile_set(1000 + int(2 * K))
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


@pytest.mark.parametrize("K", [1, 2, 2.5, 3, 3.5, 5, 6])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_many_tiles_per_block(built, K, blocks):
    """A block encodes its tiles in units (two tiles per forward pass at K 2, 2.5, 3, 4 and 5, else one) and
    keeps two units in flight: 23 tiles over 1, 2 or 3 blocks give every count of units, odd and even, and
    a unit short of a tile."""
    tiles = tile_set(77)[-23:]
    ref_values, ref_states = theirs(tiles, K, "mul1")
    values, states = kernel.encode_tiles(tiles, K, kernel.CODEBOOKS["mul1"], max_blocks=blocks)
    assert torch.equal(states, ref_states)
    assert torch.equal(values, ref_values)


def test_quantize_tiles_takes_exllamav3_arguments(built):
    """The drop-in: exllamav3's argument dict in, its outputs out, ours where it runs; exllamav3's own
    encoder at K 8."""
    tiles = tile_set(7)[:40]
    for qa in ({"K": 3, "mul1": True}, {"K": 2, "mcg": True}, {"K": 2.5, "mul1": True}):
        assert kernel.fallback_reason(tiles, qa) is None
        out = kernel.quantize_tiles(tiles, qa)
        ref = theirs(tiles, qa["K"], "mul1" if qa.get("mul1") else "mcg")
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
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


def same_tensors(theirs, ours) -> None:
    for a_linear, b_linear in zip(theirs, ours, strict=True):
        assert b_linear.proxy_err == a_linear.proxy_err
        a, b = a_linear.tensors("w"), b_linear.tensors("w")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def expert_inputs(seed: int, experts: int = 2, out_f: int = 2304, in_f: int = 5120):
    """Routed-expert w1 of V4.1's shape (by default) and a Hessian of 6144 random rows each."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = [0.02 * torch.randn(out_f, in_f, device="cuda", generator=g) for _ in range(experts)]
    rows = [torch.randn(6144, in_f, device="cuda", generator=g) for _ in range(experts)]
    return weights, [x.T @ x for x in rows]


@pytest.mark.parametrize("K", [1, 2, 3, 4, 1.5, 2.5, 3.5])
def test_our_conversion_stores_exllamav3s_tensors(built, K):
    """What the quantize stage runs (quantize_batch) on two routed-expert w1 of V4.1's shape with a Hessian
    each: with --encoder ours (our loop, the Hessians kept on the GPU, our kernel, at half rates too) every
    stored tensor and the proxy error equal exllamav3's own conversion."""
    from quantizer.codec.exllamav3_adapter import quantize_batch

    weights, hessians = expert_inputs(int(K * 10))
    out = {how: quantize_batch(weights, K, hessians, counts=[6144, 6144], seed=5, encoder=how)
           for how in ("exllamav3", "ours")}
    same_tensors(out["exllamav3"], out["ours"])


@pytest.mark.parametrize("K", [2, 3])
def test_our_loop_with_exllamav3s_kernel_equals_quantize_exl3_batch(built, K):
    """The loop alone (exllamav3's tile kernel in both runs), with distinct Hessians (ldlq_batched) and with
    one shared Hessian (one LDLQ over the concatenated weights): the same results and the same g_scale."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3_batch

    from quantizer.codec.exllamav3_batch import quantize_exl3_batch_on_device

    weights, hessians = expert_inputs(40 + K, experts=3, out_f=512, in_f=1024)
    for shared in (False, True):
        runs = []
        for convert in (quantize_exl3_batch, quantize_exl3_batch_on_device):
            h_datas = ([h_data(hessians[0])] * 3) if shared else [h_data(h) for h in hessians]
            qas = [{"K": K, "devices": [0], "seed": 9 + i, "mul1": True, "mcg": False, "apply_out_scales": None}
                   for i in range(3)]
            with torch.random.fork_rng(devices=[0]):
                results = convert([w.T.contiguous() for w in weights], h_datas, qas)
            runs.append((results, [qa["g_scale"] for qa in qas]))
        (theirs, g_theirs), (ours, g_ours) = runs
        assert g_ours == g_theirs
        for (pa, ta), (pb, tb) in zip(theirs, ours, strict=True):
            assert pb == pa and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f"shared {shared}"


def h_data(h: torch.Tensor, count: int = 6144) -> dict:
    return {"H": h.clone(), "packed": False, "n": h.shape[0], "first_key": "t", "count": count, "finalized": False,
            "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device="cuda"), "device": torch.device("cuda", 0)}


@pytest.mark.parametrize("case", ["uncalibrated", "non-finite"])
def test_inputs_our_loop_does_not_take_go_to_exllamav3_whole(built, case):
    """An uncalibrated member (no Hessian) or a non-finite Hessian: exllamav3's fallbacks run, on inputs
    our loop has not changed, so --encoder ours stores what exllamav3 stores."""
    from quantizer.codec.exllamav3_adapter import quantize_batch

    weights, hessians = expert_inputs(77, out_f=256, in_f=512)
    if case == "uncalibrated":
        hessians[1], counts = None, [6144, 0]
    else:
        hessians[1][3, 3], counts = float("nan"), [6144, 6144]
    out = {how: quantize_batch(weights, 3, hessians, counts=counts, seed=5, encoder=how)
           for how in ("exllamav3", "ours")}
    same_tensors(out["exllamav3"], out["ours"])


def test_a_kept_build_is_found_where_torch_put_it(built):
    """After a compile or load, is_built() finds torch's build in its real layout (default root or
    $TORCH_EXTENSIONS_DIR), so a later quantize stage loads it without announcing a compile."""
    assert kernel.is_built()
    said = []
    assert kernel.load(said.append) and said == []
