"""fit: 128-block splits, placement per class, KV bytes per engine, and the real V4.1-Flash shape on
1/2/4 Sparks at 2.5/2.9/3.5 bpw checked against what users report (docs/gb10-memory.md)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import load_profile
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.rules import for_profile, make_plan
from quantizer.errors import UserError
from quantizer.fit.hardware import Term, derived_kv_bytes_per_token, load_hardware, swa_ring_bytes
from quantizer.fit.memory import FitOptions, FitTarget, fit, fit_table
from quantizer.fit.placement import Options, block_split, rank_weights
from quantizer.fit.target import largest_fitting_plan
from quantizer.model.targets import targets
from quantizer.plan.recipe import plan_from_recipe, read_recipe
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path

GIB = 1 << 30


@pytest.fixture
def v41(real_v41):  # tests/conftest.py: shared by the session
    return real_v41


@pytest.fixture
def pack(real_v41_uniform_spec):
    """Stored tensors of the uniform plan at a bpw, built once per bpw and session."""
    return lambda bpw: real_v41_uniform_spec(bpw).tensors


def test_block_splits():
    # docs/gb10-memory.md: EXL3 splits land on 128-wide blocks
    assert block_split(2304, 4) == [640, 640, 512, 512]
    assert block_split(2304, 2) == [1152, 1152]
    assert block_split(129_280, 4) == [32_384, 32_384, 32_256, 32_256]
    assert block_split(5120, 1) == [5120]
    assert block_split(200, 2) == [128, 72]  # a ragged last block comes off the last rank


def test_kv_and_ring_bytes_from_the_architecture(v41):
    v4 = ModelConfig.from_file(model_config_path("deepseek-v4-flash-0731.json"))
    assert derived_kv_bytes_per_token(v41, "native") == 890  # 2.5 x (288 + 68)
    assert derived_kv_bytes_per_token(v4, "native") == 3514.25  # 5.40625 x 584 + 5.25 x 68
    assert derived_kv_bytes_per_token(v41, "fp16") == 3200  # 2.5 x (512 + 128) x 2
    assert derived_kv_bytes_per_token(v41, "fp16", kv_bits=4) == 2.5 * (448 / 2 + 128 + 28) + 2.5 * 256
    hw = load_hardware()
    # 1-Spark bf16 engine: SWA rings 180,355,072 B = 43 rings x 4,096 rows x 1,024 B
    assert swa_ring_bytes(v41, hw.engine("exllamav3"), drafter_on=True) == 180_355_072
    assert swa_ring_bytes(v41, hw.engine("native"), drafter_on=False) == 40 * 128 * 528  # 2.70 MB


def test_placement_tp4_and_ep(v41, pack):
    stored = pack(2.9)
    tp = rank_weights(v41, stored, Options(4)).by_class
    # routed gate/up split 640/640/512/512 on 128-blocks: two ranks carry more
    assert tp[0]["routed_expert"] == tp[1]["routed_expert"] > tp[2]["routed_expert"] == tp[3]["routed_expert"]
    trellis_ratio = (tp[0]["routed_expert"] - tp[2]["routed_expert"]) / sum(d["routed_expert"] for d in tp)
    assert 0.05 < trellis_ratio < 0.06  # (640 - 512) / 2304 of the trellis bytes
    for cls in ("router", "compressor", "indexer", "mhc", "norm"):
        assert len({d[cls] for d in tp}) == 1  # replicated
    assert tp[0]["vision"] > 0 and all("vision" not in d for d in tp[1:])
    assert all("engram_table" not in d for d in tp)  # on NVMe by default
    ep = rank_weights(v41, stored, Options(4, split="ep")).by_class
    routed_total = sum(t.nbytes for t in stored if ".ffn.experts." in t.name and t.name.startswith("layers."))
    assert [d["routed_expert"] for d in ep] == [routed_total // 4] * 4  # 96 whole experts per rank
    one = rank_weights(v41, stored, Options(1)).by_class[0]
    assert sum(one.values()) == sum(t.nbytes for t in stored if "engram.embed" not in t.name)
    off = rank_weights(v41, stored, Options(2, drafter="off", vision="off")).by_class
    assert all("dspark_drafter" not in d and "vision" not in d for d in off)
    rank0 = rank_weights(v41, stored, Options(2, drafter="rank0")).by_class
    assert rank0[0]["dspark_drafter"] == one["dspark_drafter"] and "dspark_drafter" not in rank0[1]


# Anchors (docs/gb10-memory.md): what users ran, and what our model says about it.

def test_29_fits_two_sparks_at_1m_on_tensorfold_not_one(v41, pack):
    # jayleaton / bertholomus / soumyarupsarkar serve the 2.9 bpw pack at 1,048,576 positions on
    # two Sparks with TensorFold
    r = fit(v41, pack(2.9), FitTarget(2, 1_048_576, 1, "tensorfold"))
    assert r.fits and r.max_context == 1_048_576 and r.max_context_capped
    assert 97 < r.ranks[0].weights_gib < 101 and r.ranks[1].visible_gib == 119.6
    with pytest.raises(UserError, match="engine tensorfold runs on 2 or 4 Spark"):  # its V4.1 engine is tp = 2 (or 4)
        fit(v41, pack(2.9), FitTarget(1, 1_048_576, 1, "tensorfold"))
    one = fit(v41, pack(2.9), FitTarget(1, 1_048_576, 1, "vllm-exl3"))
    assert not one.fits and one.short_gib > 80 and one.max_context == 0
    assert one.would_fit["smallest_sparks"] == 4  # vLLM charges more per token than TensorFold: 2 Sparks are short
    assert f"short by {one.short_gib:.2f} GiB" in one.verdict and "fits 4 Sparks at this context" in one.verdict


def test_mias_map_on_vllm_two_sparks_leaves_what_mia_measured(v41):
    # MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks README.md @145bb98d: max_model_len 614,400 with the KV pool
    # pinned at 2.5 GiB a rank; after warm-up the head keeps 4.07-4.21 GiB MemAvailable, the worker 5.8 GiB
    plan = for_profile(v41, plan_from_recipe(v41, read_recipe("mia-2.9"), keep_rules=False), load_profile("vllm-exl3"))
    r = fit(v41, pack_spec(v41, plan).tensors, FitTarget(2, 614_400, 1, "vllm-exl3"))
    assert r.fits
    available = [m.free_gib + m.guard_gib + m.kv_pool_gib - 2.5 for m in r.ranks]  # with their pool in place of ours
    assert abs(available[0] - 4.14) < 0.5 and abs(available[1] - 5.8) < 0.5, available


def test_35_needs_four_sparks_with_12_gib_skew(v41, pack):
    # Pollard 3.51 runs vLLM TP4/TP3, not TP2; on TP4 the 640-wide ranks carry ~12 GiB more (tonyd2wild)
    assert not fit(v41, pack(3.5), FitTarget(2, 262_144, 1, "vllm-exl3")).fits
    r = fit(v41, pack(3.5), FitTarget(4, 1_048_576, 1, "vllm-exl3"))
    routed = [m.weights_by_class_gib["routed_expert"] for m in r.ranks]
    assert r.fits and 11.5 < routed[0] - routed[2] < 13 and routed[0] == routed[1]
    assert 12 < r.ranks[1].weights_gib - r.ranks[2].weights_gib < 14  # drafter experts split alike


def test_25_fits_two_sparks(v41, pack):
    assert fit(v41, pack(2.5), FitTarget(2, 1_048_576, 1, "vllm-exl3")).fits
    assert not fit(v41, pack(2.5), FitTarget(1, 65_536, 1, "vllm-exl3")).fits


def test_475_body_needs_four_sparks_ep(v41, pack):
    # "not a practical two-Spark body"; vcruz305 serves 4.75 with vLLM TP4+EP4
    assert not fit(v41, pack(4.75), FitTarget(2, 8192, 1, "vllm-exl3")).fits
    r = fit(v41, pack(4.75), FitTarget(4, 1_048_576, 1, "vllm-exl3"), FitOptions(split="ep"))
    assert r.fits and max(m.weights_gib for m in r.ranks) - min(m.weights_gib for m in r.ranks) < 1.5


def test_16_streams_sharing_2m_on_four_sparks(v41, pack):
    # bertholomus: TP4 serves 16 streams sharing a 2,097,152-position window on the 2.9 pack
    assert fit(v41, pack(2.9), FitTarget(4, 131_072, 16, "tensorfold")).fits


def test_159_class_fits_one_spark(v41, pack):
    # SAGE 1.59 runs on one Spark with exllamav3 TP1, ~107-111 GiB resident, no drafter or vision
    r = fit(v41, pack(1.59), FitTarget(1, 32_768, 1, "exllamav3"), FitOptions(drafter="off", vision="off"))
    assert r.fits and 100 < r.ranks[0].weights_gib < 112 and r.max_context >= 32_768
    assert not fit(v41, pack(1.59), FitTarget(1, 32_768, 1, "exllamav3")).fits  # with the drafter and vision


def test_resident_engram_does_not_fit(v41, pack):
    # fattchris: TP4 resident Engram at 8K reached ~121 GiB used, ~0.5 GiB available -> CAPACITY_FAIL;
    # TP2 would need ~94 GiB of tables per node (jayleaton)
    two = fit(v41, pack(2.9), FitTarget(2, 8192, 1, "vllm-exl3"), FitOptions(engram="resident"))
    assert not two.fits and two.ranks[0].weights_by_class_gib["engram_table"] == pytest.approx(188.83 / 2, abs=0.01)
    # fattchris's case: the 4.75 bpw pack on vLLM TP4 + EP4 (96 whole experts a rank)
    four = fit(v41, pack(4.75), FitTarget(4, 8192, 1, "vllm-exl3"), FitOptions(split="ep", engram="resident"))
    assert not four.fits and four.ranks[0].weights_by_class_gib["engram_table"] == pytest.approx(188.83 / 4, abs=0.01)
    assert fit(v41, pack(4.75), FitTarget(4, 8192, 1, "vllm-exl3"), FitOptions(split="ep")).fits


# Published per-rank weights (docs/gb10-memory.md, "Published packs the fit is checked against"): the bit maps of
# configs/recipes/published, each rank's weights in GiB as published, in the engine and on the Sparks that ran
# them, and whether the number holds the vision encoder. Every rank within 2%.
PUBLISHED_RANKS = [
    # bertholomus/deepseek-v4.1-tensorfold-tp2-2xgb10 README.md @5e90ec93: the rank cache, "~106 GB a rank"
    ("mia-2.9", "tensorfold", 2, [106e9 / GIB] * 2, False),
    # jayleaton's budget (TensorFold TP2): 98.9 GiB on rank 0 with the vision tower, 98.0 without
    ("mia-2.9", "tensorfold", 2, [98.9, 98.0], True),
    # bertholomus/deepseek-v4.1-tensorfold-tp4-4xgb10 README.md @6033ea48: "all four weight files (56.2 GB each)"
    ("mia-2.9", "tensorfold", 4, [56.2e9 / GIB] * 4, False),
    # MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks README.md @145bb98d: "EXL3 weights per rank 99.5" (vLLM)
    ("mia-2.9", "vllm-exl3", 2, [99.5, 99.5], True),
    # tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark docs/EXL3-TP3.md @0d54f51f: vLLM's "Model loading took", DSpark
    # and vision, 56.6 on the two 512-wide ranks and 68.9 on the two 640-wide ones (there ranks 1 and 2; the
    # vllm-exl3 plugin gives the wide slices to ranks 0 and 1)
    ("pollard-3.51", "vllm-exl3", 4, [68.9, 68.9, 56.6, 56.6], True),
]


@pytest.mark.parametrize("recipe, loader, sparks, published, with_vision", PUBLISHED_RANKS)
def test_per_rank_weights_of_the_published_packs_are_within_2_percent(v41, recipe, loader, sparks, published,
                                                                       with_vision):
    plan = for_profile(v41, plan_from_recipe(v41, read_recipe(recipe), keep_rules=False), load_profile(loader))
    ranks = fit(v41, pack_spec(v41, plan).tensors, FitTarget(sparks, 300_000, 1, loader)).ranks
    ours = [m.weights_gib - (0 if with_vision else m.weights_by_class_gib.get("vision", 0)) for m in ranks]
    assert all(abs(o / p - 1) < 0.02 for o, p in zip(ours, published)), (ours, published)


@pytest.mark.parametrize("recipe, sparks", [("mia-2.9", 2), ("pollard-3.51", 4), ("sfxnz-2.0", 2)])
def test_the_published_maps_fit_their_sparks_in_the_profile_they_meet(recipe, sparks, capsys):
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", recipe, "--sparks", str(sparks),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["findings"] is None and data["context"] == 1_048_576
    if sparks == 4 and data["engine"] == "vllm-exl3":  # the 128-block split: two wide ranks, two narrow
        weights = [round(m["weights_by_class_gib"]["routed_expert"], 3) for m in data["ranks"]]
        assert weights[0] == weights[1] > weights[2] == weights[3]


def _tiny_spark():
    """The tiny model with a Spark shrunk to ~14 MiB, so the fit boundary sits mid-range."""
    tiny = ModelConfig.from_file(model_config_path("tiny-v41.json"))
    small = replace(load_hardware(), visible_gib=Term(14 / 1024, "test"), worker_shortfall_gib=Term(0, "test"),
                    os_reserve_gib=Term(0, "test"), guard_gib=Term(0, "test"),
                    engram_cache_rows_per_table=Term(0, "test"))
    return tiny, small


def test_highest_bpw_is_the_boundary():
    tiny, small = _tiny_spark()
    stored_at = lambda b: pack_spec(tiny, uniform_plan(tiny, b)).tensors  # noqa: E731
    r = fit(tiny, stored_at(5.0), FitTarget(1, 64, 1, "native"), hardware=small, stored_at_bpw=stored_at, bpw=5.0)
    best = r.would_fit["highest_bpw"]
    assert not r.fits and 2.5 < best < 5.0 and f"--bpw {best:g} fits 1 Spark" in r.verdict
    assert fit(tiny, stored_at(best), FitTarget(1, 64, 1, "native"), hardware=small).fits
    assert not fit(tiny, stored_at(round(best + 0.05, 2)), FitTarget(1, 64, 1, "native"), hardware=small).fits


def test_fit_suggests_what_plan_sparks_finds():
    # one search: fit's "--bpw B fits" and the largest plan `plan/build --sparks` choose end at one bpw
    tiny, small = _tiny_spark()
    stored_at = lambda b: pack_spec(tiny, uniform_plan(tiny, b)).tensors  # noqa: E731
    best = fit(tiny, stored_at(5.0), FitTarget(1, 64, 1, "native"), hardware=small, stored_at_bpw=stored_at,
               bpw=5.0).would_fit["highest_bpw"]
    fitted = largest_fitting_plan(tiny, lambda b: uniform_plan(tiny, b), 1.0, 5.0, FitTarget(1, 64, 1, "native"), small)
    plan, report = fitted.plan, fitted.report
    assert report.fits and best == math.floor(plan.target_bpw * 100) / 100


def test_a_fit_inside_the_margin_says_so_and_the_largest_plan_keeps_it():
    tiny, small = _tiny_spark()
    plan_at = lambda b: uniform_plan(tiny, b)  # noqa: E731
    target = FitTarget(1, 64, 1, "native")
    most = largest_fitting_plan(tiny, plan_at, 1.0, 5.0, target, small)
    free = most.report.ranks[most.report.worst_rank].free_gib
    assert most.report.fits and "margin" not in most.report.verdict
    margin = free + 2 / 1024  # two MiB more than the plan with the most bits leaves
    inside = fit(tiny, pack_spec(tiny, most.plan).tensors, replace(target, margin_gib=margin), hardware=small)
    assert inside.fits and f"less than the {margin:g} GiB margin" in inside.verdict
    kept = largest_fitting_plan(tiny, plan_at, 1.0, 5.0, replace(target, margin_gib=margin), small)
    assert kept.report.ranks[kept.report.worst_rank].free_gib >= margin
    assert kept.plan.target_bpw < most.plan.target_bpw


def test_report_json_and_bad_inputs(v41, pack):
    r = fit(v41, pack(2.9), FitTarget(4, 1_048_576, 2, "vllm-exl3"))
    data = json.loads(r.to_json())
    assert [m["weights_gib"] for m in data["ranks"]] == [m.weights_gib for m in r.ranks]
    assert {"fits", "verdict", "max_context", "short_gib", "worst_rank", "would_fit", "terms"} <= set(data)
    assert data["ranks"][0]["kv_pool_gib"] == pytest.approx(2 * 1_048_576 * 3752 / GIB)
    assert all(t["source"] for t in data["terms"])
    with pytest.raises(UserError, match=r"engine exllamav3 runs on 1 Spark\(s\) only"):
        fit(v41, pack(2.9), FitTarget(2, 8192, 1, "exllamav3"))
    with pytest.raises(UserError, match="unknown engine"):
        fit(v41, pack(2.9), FitTarget(2, 8192, 1, "sglang"))
    with pytest.raises(UserError, match="--kv-bits applies"):
        fit(v41, pack(2.9), FitTarget(2, 8192, 1, "vllm-exl3"), FitOptions(kv_bits=4))
    with pytest.raises(UserError, match="beyond the model's 1,048,576 positions"):
        fit(v41, pack(2.9), FitTarget(4, 2_097_152, 1, "vllm-exl3"))


def test_fit_table_for_the_manifest_names_one_engine(v41, pack):
    table = fit_table(v41, pack(2.9), context=1_048_576, engine="tensorfold")
    assert json.loads(json.dumps(table)) == table
    # TensorFold's V4.1 engine runs on 2 or 4 ranks; no other engine, and never the design floor, has a row
    assert {n: set(row) for n, row in table["topologies"].items()} == {"2": {"tensorfold"}, "4": {"tensorfold"}}
    assert table["topologies"]["2"]["tensorfold"]["fits"]
    vllm = fit_table(v41, pack(2.9), context=1_048_576, engine="vllm-exl3")["topologies"]
    assert set(vllm) == {"1", "2", "4"} and not vllm["1"]["vllm-exl3"]["fits"] and len(vllm["4"]["vllm-exl3"]["weights_gib"]) == 4


def test_engram_tables_left_out_of_a_pack_count_when_resident(v41, pack):
    with_tables = pack(2.9)
    without = [t for t in with_tables if ".engram.embed." not in t.name]
    for engram in ("resident", "scales"):
        a = rank_weights(v41, with_tables, Options(2, engram=engram)).by_class
        b = rank_weights(v41, without, Options(2, engram=engram)).by_class
        assert a == b and a[0]["engram_table"] > 0
    scales = rank_weights(v41, without, Options(2, engram="scales")).by_class[0]["engram_table"]
    assert scales == sum(v41.engram_rows(L) * 8 for L in (1, 14)) // 2  # 8 E8M0 bytes per row, half the heads


def test_v4_0731_shape_fits():
    # V4-Flash-0731 (155 GiB native): the same code sizes the V4 layout, its FP8 KV entries included
    v4 = ModelConfig.from_file(model_config_path("deepseek-v4-flash-0731.json"))
    plan = uniform_plan(v4, 2.5)
    stored = pack_spec(v4, plan).tensors
    r = fit(v4, stored, FitTarget(1, 65_536, 1, "native"))
    assert r.kv_bytes_per_token == 3514.25 and r.fits
    assert r.ranks[0].weights_gib * GIB == plan.expected_bytes["total"]  # one rank holds it all
    four = fit(v4, stored, FitTarget(4, 65_536, 1, "vllm-exl3"))
    head = [m.weights_by_class_gib["head"] for m in four.ranks]  # vocab 32,384 / 32,384 / 32,256 / 32,256
    assert four.fits and head[0] == head[1] > head[2] == head[3]


def test_wo_a_slices_split_by_group(v41):
    """A pack stores a quantized wo_a as o_groups slices; tensor parallelism gives each rank whole
    groups, so the slices' bytes divide by the ranks instead of repeating on each."""
    plan = make_plan(v41, {t.key: (4.0 if t.proj == "wo_a" else None) for t in targets(v41)})
    slices = [t for t in pack_spec(v41, plan).tensors if ".wo_a.slice." in t.name]
    assert len({t.name.split(".slice.")[1].split(".")[0] for t in slices}) == v41.o_groups
    (whole,) = rank_weights(v41, slices, Options(1)).totals
    for sparks in (2, 4):
        assert rank_weights(v41, slices, Options(sparks)).totals == [whole // sparks] * sparks
