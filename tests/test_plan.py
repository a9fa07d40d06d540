"""plan: EXL3 targets of V4.1-Flash, tensor sizes, the uniform plan against the packs catalogue,
plan checks and persistence."""

from __future__ import annotations

import json

import pytest

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import EXLLAMAV3, TENSORFOLD, VLLM_EXL3, load_profile
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.exl3 import check_k, exl3_bytes, k_from_trellis, leaf_layout
from quantizer.model.targets import ROUTED, quantizable, target_map, targets
from quantizer.model.tensor_classes import ATTENTION, HEAD, ROUTED_EXPERT, classify
from quantizer.plan.uniform import lowest_uniform_bpw, uniform_plan
from quantizer.shipped import model_config_path

GIB = 1 << 30


@pytest.fixture
def v41(real_v41):  # tests/conftest.py: shared by the session
    return real_v41


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_file(model_config_path("tiny-v41.json"))


@pytest.fixture
def plan29(real_v41_uniform):
    return real_v41_uniform(2.9)


def test_v41_targets_by_group(v41):
    groups: dict[str, list] = {}
    for t in targets(v41):
        groups.setdefault(t.group, []).append(t)
    counts = {g: len(ts) for g, ts in groups.items()}
    # attention: 40 layers x 5 projections + the compressors' wkv/wgate (4 KV-source layers, 3 of them gated);
    # indexer: 8 queries (wq_b) + 4 key projections (wk), as exllamav3 budgets its V4 attention block
    assert counts == {"routed": 46_080, "shared": 120, "attention": 207, "indexer": 12, "engram": 2,
                      "head": 1, "drafter": 1_177}
    numel = {g: sum(t.numel for t in ts) for g, ts in groups.items()}
    # docs/deepseek-v4-layout.md: routed params 543,581,798,400; attention class 5,064,696,320
    # minus its norms and sinks (40 x (1280 + 512 + 64) = 74,240)
    assert numel["routed"] == 543_581_798_400
    compressors = 7 * 5120 * 512  # the compressor class: wkv/wgate [512, 5120]
    assert numel["attention"] == 5_064_696_320 - 74_240 + compressors
    assert numel["shared"] == 1_415_577_600
    budgeted = sum(t.numel for t in targets(v41) if t.budgeted)
    assert budgeted == (543_581_798_400 + 1_415_577_600 + 5_064_622_080 + compressors
                        + 41_943_040 + 4 * 512 * 128 + 314_572_800)
    assert {t.group for t in targets(v41) if t.budgeted} == {"routed", "shared", "attention", "indexer", "engram"}


def test_quantizable_names(v41):
    yes = ["layers.3.ffn.experts.5.w1.weight", "layers.0.ffn.shared_experts.w2.weight", "layers.7.attn.wo_a.weight",
           "layers.2.attn.indexer.wq_b.weight", "layers.14.engram.wkv.weight", "head.weight",
           "mtp.0.main_proj.weight", "mtp.1.ffn.experts.127.w3.weight", "mtp.2.attn.wkv.weight",
           "layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.wk.weight"]  # budgeted as exllamav3 does
    no = ["embed.weight", "layers.3.ffn.gate.weight",
          "layers.2.attn.indexer.weights_proj.weight", "layers.0.attn.q_norm.weight",
          "layers.1.engram.embed.weight", "layers.1.engram.q_weight", "layers.3.ffn.experts.5.w1.scale",
          "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight", "vision.blocks.0.attn.wqkv.weight"]
    assert all(quantizable(v41, n) for n in yes)
    assert not any(quantizable(v41, n) for n in no)
    tmap = target_map(v41)
    down = tmap["layers.3.ffn.experts.5.w2"]
    assert (down.in_features, down.out_features) == (2304, 5120)
    assert tmap["layers.3.attn.wq_b"].integer_only and tmap["layers.2.attn.indexer.wq_b"].integer_only
    assert not tmap["layers.3.ffn.experts.5.w1"].integer_only and not tmap["mtp.0.main_proj"].integer_only


def test_classify_knows_exl3_leaves():
    for leaf in ("trellis", "suh", "svh", "mul1", "mcg", "bias"):
        c = classify(f"layers.3.ffn.experts.5.w2.{leaf}")
        assert (c.cls, c.layer, c.expert, c.proj) == (ROUTED_EXPERT, 3, 5, "w2")
        assert classify(f"head.{leaf}").cls == HEAD
        assert classify(f"layers.3.attn.wq_a.{leaf}").cls == ATTENTION
    assert classify("hc_head_fn").cls == "mhc"


def test_exl3_tensor_sizes():
    # docs/exl3-format.md, stored tensors: trellis int16 [in/16, out/16, 16K], suh [in], svh [out], int32 marker
    leaves = {suffix: (shape, dtype, nbytes) for suffix, shape, dtype, nbytes in leaf_layout(5120, 2304, 2.5, "mul1")}
    assert leaves[".trellis"] == ((320, 144, 40), "I16", 5120 * 2304 * 2.5 / 8)
    assert leaves[".suh"][0] == (5120,) and leaves[".svh"][0] == (2304,) and leaves[".mul1"] == ((), "I32", 4)
    assert exl3_bytes(5120, 2304, 2.5) == 5120 * 2304 * 2.5 / 8 + 2 * 5120 + 2 * 2304 + 4
    assert exl3_bytes(5120, 2304, 3, "3inst") == 5120 * 2304 * 3 // 8 + 2 * (5120 + 2304)  # no marker
    assert exl3_bytes(5120, 2304, 16) == 5120 * 2304 * 2  # 16: unquantized fp16
    assert k_from_trellis((320, 144, 40)) == 2.5
    check_k(3.5, "mul1", False, "x")
    with pytest.raises(UserError, match="integer K only"):
        check_k(2.5, "mul1", True, "layers.0.attn.wq_b")
    with pytest.raises(UserError, match="needs the mul1 codebook"):
        check_k(2.5, "mcg", False, "x")
    with pytest.raises(UserError, match="not an EXL3 rate"):
        check_k(9, "mul1", False, "x")


def test_uniform_plan_29_k_map_and_pack_size(v41, plan29):
    k = plan29.k
    layer_k = [k[f"layers.{L}.ffn.experts.0.w1"] for L in range(40)]
    # 30 layers at K3 nearest the ends of the stack, 10 middle layers at K2.5: routed mean 2.875,
    # the same mean as Mia's K map (K3, L18-22 at K2); docs/gb10-memory.md, published packs
    assert layer_k == [3.0] * 15 + [2.5] * 10 + [3.0] * 15
    assert sum(layer_k) / 40 == 2.875
    assert all(k[f"layers.{L}.ffn.experts.{e}.{p}"] == layer_k[L]
               for L in (0, 20) for e in (0, 383) for p in ("w1", "w2", "w3"))
    assert {k[t.key] for t in targets(v41) if t.group in ("shared", "attention", "indexer", "engram")} == {4.0}
    assert k["head"] == 6.0 and plan29.head_bits == 6.0
    assert {k[t.key] for t in targets(v41) if t.group == "drafter"} == {None}
    # the budget: exllamav3 `bits` at most the target, within one layer's promotion (0.0123 bpw)
    assert 2.9 - 0.0124 < plan29.achieved_bpw <= 2.9
    # packs catalogue: Mia 2.9 bpw pack is 196-197 GiB without Engram (MTP at K4 instead of our
    # native drafter, attention K5 instead of 4: +0.6 GiB, -0.7 GiB, so the same size class)
    resident = plan29.expected_bytes["total_without_engram_tables"] / GIB
    assert 195.0 < resident < 198.0
    # routed: 67,947,724,800 B per bpw + suh/svh 0.64 GiB + markers (docs/exl3-format.md, bits per weight)
    routed = plan29.expected_bytes["routed_expert"]
    assert routed == 67_947_724_800 * 2.875 + 46_080 * (2 * (5120 + 2304) + 4)


@pytest.mark.parametrize("bpw", [1.59, 2.0, 2.5, 3.5, 4.75])
def test_uniform_plan_hits_the_budget(real_v41_uniform, bpw):
    plan = real_v41_uniform(bpw)
    step = 1.0 if bpw >= 4 else 0.5  # the rate grid above 4 has integer steps only
    one_layer = step * 13_589_544_960 / 550_418_513_920
    assert bpw - one_layer <= plan.achieved_bpw <= bpw + 1e-9
    layer_k = {plan.k[f"layers.{L}.ffn.experts.0.w1"] for L in range(40)}
    assert len(layer_k) <= 2 and max(layer_k) - min(layer_k) <= step


def test_uniform_plan_too_low_and_tiny_models(v41, tiny):
    with pytest.raises(UserError, match="too low"):
        uniform_plan(v41, 0.9)
    for name in ("tiny-v41.json", "tiny-v4.json", "deepseek-v4-flash-0731.json"):
        cfg = ModelConfig.from_file(model_config_path(name))
        plan = uniform_plan(cfg, 3.0)
        assert plan.achieved_bpw <= 3.0 and set(plan.k) == set(target_map(cfg))


@pytest.mark.parametrize("loader", [EXLLAMAV3, VLLM_EXL3])
def test_lowest_uniform_bpw_is_the_first_bpw_uniform_plan_accepts(v41, loader):
    """fit and `--sparks` start their search for the most bits that fit here instead of bisecting from
    1 bpw: uniform_plan takes it, with the routed experts at the profile's lowest rate, and refuses
    anything a hair below."""
    lowest = lowest_uniform_bpw(v41, profile=load_profile(loader))
    plan = uniform_plan(v41, lowest, profile=load_profile(loader))
    routed = {plan.k[t.key] for t in targets(v41) if t.group == ROUTED}
    assert routed == {1.0 if loader == EXLLAMAV3 else 2.0}
    with pytest.raises(UserError, match="too low"):
        uniform_plan(v41, lowest - 1e-6, profile=load_profile(loader))
    assert lowest_uniform_bpw(v41, floor=6.0) > lowest_uniform_bpw(v41)  # a higher floor needs more bits


def test_plan_save_load_and_hash(tiny, tmp_path):
    plan = uniform_plan(tiny, 2.5)
    path = plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back.k == plan.k and back.content_hash() == plan.content_hash()
    assert back.expected_bytes == plan.expected_bytes
    assert not (tmp_path / "plan.json.tmp").exists()
    data = json.loads(path.read_text())
    data["k"]["layers.0.attn.wq_a"] = 8.0
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="content_hash does not match"):
        Plan.load(path)
    del data["content_hash"]
    path.write_text(json.dumps(data))
    assert Plan.load(path).k["layers.0.attn.wq_a"] == 8.0
    path.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        Plan.load(path)


def test_loader_profiles_and_aliases(tiny):
    k = dict(uniform_plan(tiny, 3.0).k)
    k["layers.2.ffn.experts.1.w2"] = 1.0  # below the layer's K (tiny: attention takes much of the budget)
    with pytest.raises(UserError, match=r"layers\.2\.ffn\.experts: experts of one projection must share one K.*"
                                        r"rule one_k_per_projection: exllamav3/modules/multilinear\.py"):
        make_plan(tiny, k, profile=load_profile(EXLLAMAV3))
    tied = dict(uniform_plan(tiny, 3.0).k)
    tied.update({f"layers.4.ffn.experts.{e}.w3": 3.0 for e in range(tiny.n_routed_experts)})
    with pytest.raises(UserError, match=r"gate \(w1\) and up \(w3\) must share one K.*rule gate_up_tied"):
        make_plan(tiny, tied, profile=load_profile(EXLLAMAV3))
    with pytest.raises(UserError, match="rule codebook"):
        make_plan(tiny, uniform_plan(tiny, 3.0, codebook="3inst").k, codebook="3inst", profile=load_profile(EXLLAMAV3))
    for loader in (EXLLAMAV3, VLLM_EXL3, TENSORFOLD):  # no engine reads an alias map
        with pytest.raises(UserError, match="rule aliases"):
            make_plan(tiny, uniform_plan(tiny, 3.0, profile=load_profile(loader)).k, profile=load_profile(loader),
                      aliases={"layers.2.ffn.experts.1": "layers.2.ffn.experts.0"})
    # K per expert where the engine takes it (tensorfold): one expert lowered costs fewer bytes
    per_expert = dict(uniform_plan(tiny, 3.0, profile=load_profile(TENSORFOLD)).k)
    per_expert["layers.2.ffn.experts.1.w2"] = 1.0
    mixed = make_plan(tiny, per_expert, profile=load_profile(TENSORFOLD))
    base = make_plan(tiny, uniform_plan(tiny, 3.0, profile=load_profile(TENSORFOLD)).k, profile=load_profile(TENSORFOLD))
    assert base.k["layers.2.ffn.experts.0.w2"] > mixed.k["layers.2.ffn.experts.1.w2"]
    assert mixed.expected_bytes["routed_expert"] < base.expected_bytes["routed_expert"]
    with pytest.raises(UserError, match="same layer"):
        make_plan(tiny, per_expert, profile=load_profile(TENSORFOLD),
                  aliases={"layers.2.ffn.experts.1": "layers.3.ffn.experts.0"})
    with pytest.raises(UserError, match="not a routed expert"):
        make_plan(tiny, per_expert, profile=load_profile(TENSORFOLD),
                  aliases={"layers.2.ffn.experts.99": "layers.2.ffn.experts.0"})
    k.pop("head")
    with pytest.raises(UserError, match="no K for 1 target"):
        make_plan(tiny, k, profile=load_profile(EXLLAMAV3))
