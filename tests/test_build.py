"""`quantizer build` on the CPU: the bundled small V4.1 checkpoint at a uniform 2.5 bpw, quantized by our
codec (fast encoder), packed under a small shard cap so the layout rules show, and verified. (The small
model has every tensor kind of the tiny one in a third of its weights: the encoder's work here.)

The uniform plan quantizes every budgeted target (routed experts at K 1.5 and 2, attention with its
compressors, indexer, shared experts and Engram wkv at the K 4 floor) and the head at K 6; the drafter,
norms, router, mHC and Engram tables stay native. Fused `wo_a` is stored as exllamav3's two slices.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors_check import assert_safetensors_agree

from quantizer.orchestrate.stages import plan_files
from quantizer.checkpoint.safetensors_file import PAD_PREFIX, read_bytes, read_header
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.cli import main
from quantizer.codec import EXL3Linear, dequantize
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.fit.memory import FitTarget, fit
from quantizer.fit.stored import stored_from_pack
from quantizer.model.targets import targets
from quantizer.pack.manifest import MANIFEST_NAME, Manifest
from quantizer.ppl.exllamav3_engine import budgeted_bytes, stored_bpw, stored_k
from quantizer.shipped import shipped

pytestmark = pytest.mark.slow  # builds packs of the bundled model: `make test-fast` skips it

CAP = 4 << 20
BPW = "2.5"
SIDE_FILES = {"tokenizer.json": "{}", "generation_config.json": '{"bos_token_id": 0}'}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    src = shutil.copytree(shipped("small_model"), root / "src")
    for name, text in SIDE_FILES.items():
        (src / name).write_text(text)
    assert main(["build", str(src), "--bpw", BPW, "--out", str(root / "pack"), "--shard-size", str(CAP),
                 "--method", "uniform", "--no-calibrate", "--loader", "exllamav3"]) == 0
    assert_safetensors_agree(src, root / "pack")  # our writer and reader against the safetensors package
    return src, root / "pack"


def _headers(pack):
    return {p.name: read_header(p) for p in sorted(pack.glob("*.safetensors"))}


def test_the_pack_verifies_clean_and_the_work_stays_resumable(built, capsys):
    _, pack = built
    assert main(["verify", str(pack), "--full"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("clean")
    pads = sum(n.startswith(PAD_PREFIX) for h in _headers(pack).values() for n in h.tensors)
    assert pads and f"not their {pads:,} alignment pads" in out  # the index leaves them out, and says so
    assert (pack.with_name("pack.work") / "quantize" / "job.json").exists()
    assert not pack.with_name("pack.partial").exists()


def test_every_tensor_is_64_byte_aligned_and_the_index_names_exactly_what_the_shards_hold(built):
    _, pack = built
    held = {}
    for file, h in _headers(pack).items():
        for name, e in h.tensors.items():
            assert e.offset % 64 == 0 or name.startswith(PAD_PREFIX), (file, name)
            if not name.startswith(PAD_PREFIX):
                held[name] = file
    assert json.loads((pack / INDEX_NAME).read_text())["weight_map"] == held


def test_shards_respect_the_cap_and_engram_tables_sit_alone(built):
    _, pack = built
    manifest = Manifest.load(pack)
    assert len(manifest.shards) > 2
    for shard in manifest.shards:
        names = [n for n in read_header(pack / shard.file).tensors if not n.startswith(PAD_PREFIX)]
        is_table = [".engram.embed." in n for n in names]
        assert shard.engram == all(is_table) and (all(is_table) or not any(is_table)), shard.file
        assert shard.bytes <= CAP + (64 << 10) or len(names) == 1, shard.file


def test_native_tensors_are_byte_identical_and_none_is_dropped(built):
    src, pack = built
    source = Checkpoint.open(src)
    packed = Checkpoint.open(pack)
    manifest = Manifest.load(pack)
    assert set(manifest.sources) == set(source.tensors)
    native = [n for n, fate in manifest.sources.items() if fate == "native"]
    assert "layers.0.ffn.gate.bias_vl" in native and "layers.1.engram.embed.weight" in native
    assert "mtp.0.ffn.experts.0.w1.weight" in native  # the drafter stays native by default
    for name in native:
        assert read_bytes(packed.entry(name)) == read_bytes(source.entry(name)), name
    slices = ["layers.0.attn.wo_a.slice.0", "layers.0.attn.wo_a.slice.1"]
    assert manifest.sources["layers.0.attn.wo_a.weight"] == {"exl3": slices}
    assert manifest.sources["layers.0.attn.wo_a.scale"] == {"exl3": slices}
    assert manifest.sources["layers.3.ffn.experts.5.w2.weight"] == {"exl3": ["layers.3.ffn.experts.5.w2"]}
    assert "layers.0.attn.wo_a.weight" not in packed.tensors and "head.weight" not in packed.tensors


def test_the_wo_a_slices_decode_to_the_source_rows(built):
    src, pack = built
    packed = Checkpoint.open(pack)
    decoded = []
    for g in range(2):
        key = f"layers.0.attn.wo_a.slice.{g}"
        q = EXL3Linear.from_tensors({n: packed.raw(n) for n in packed.tensors if n.startswith(key + ".")}, key)
        assert q.K == 4 and q.codebook.value == "mul1"
        decoded.append(dequantize(q))
    w = Checkpoint.open(src).weight("layers.0.attn.wo_a.weight")
    error = (torch.cat(decoded) - w).square().sum() / w.square().sum()
    assert error < 0.02  # K 4 uncalibrated: about 0.005


def test_configs_announce_exl3_with_integer_bits_and_keep_the_source_quantization(built):
    src, pack = built
    source = json.loads((src / "config.json").read_text())
    config = json.loads((pack / "config.json").read_text())
    q = config["quantization_config"]
    manifest = Manifest.load(pack)
    assert q["quant_method"] == "exl3" and q["codebook"] == "mul1" and q["calibration"] is None
    assert isinstance(q["bits"], int) and q["bits"] == int(q["bpw"] + 0.5) and 2.3 < q["bpw"] <= 2.5
    assert q["head_bits"] == 6 and q["version"] == "1.6.5"
    assert q["original_quantization_config"] == source["quantization_config"]
    assert config["tie_word_embeddings"] is False and config["text_config"] == source["text_config"]
    storage = json.loads((pack / "quantization_config.json").read_text())["tensor_storage"]
    entry = storage["layers.0.attn.wo_a.slice.1"]
    assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == 4
    assert entry["mul1_multiplier"] == 0x83DCD12D
    assert entry["stored_tensors"]["layers.0.attn.wo_a.slice.1.trellis"]["shape"] == [8, 8, 64]
    assert storage["layers.3.ffn.experts.5.w2"]["bits_per_weight"] in (1.5, 2)
    assert manifest.quantization["bits"] == q["bits"]
    assert manifest.quantization["k_histogram"] == {"1.5": 120, "2": 24, "4": 64, "6": 1}  # compressors at the K 4 floor
    for name, text in SIDE_FILES.items():
        assert (pack / name).read_text() == text


def test_the_manifest_records_provenance_totals_and_the_fit_table(built):
    src, pack = built
    m = Manifest.load(pack)
    assert m.source["path"] == str(src) and m.source["fingerprint"].startswith("sha256:")
    assert m.settings["device"] == "cpu" and m.settings["encoder"] == "fast" and m.settings["seed"] == 0
    assert m.tool["exllamav3_target"] == "1.6.5" and m.tool["exllamav3"] is None
    assert m.tensors["layers.0.attn.wo_a.slice.0.trellis"].K == 4 and m.tensors["head.trellis"].K == 6
    assert m.tensors["embed.weight"].K == "native"
    assert sum(t["bytes"] for t in m.totals.values()) == json.loads((pack / INDEX_NAME).read_text())["metadata"]["total_size"]
    assert 1.5 < m.totals["routed_expert"]["bpw"] < 2.0  # K 1.5 and 2 plus suh/svh/marker overheads
    assert "fit" not in json.loads((pack / MANIFEST_NAME).read_text())  # computed when asked: pack_fit_table


def test_a_manifest_k_that_disagrees_with_the_trellis_is_a_fault(built, tmp_path, capsys):
    _, pack = built
    copy = shutil.copytree(pack, tmp_path / "pack")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["tensors"]["layers.0.attn.wo_a.slice.1.trellis"]["K"] = 3
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "FAULT layers.0.attn.wo_a.slice.1: trellis holds K=4 but the manifest says K=3" in out


def test_the_plan_predicts_the_packs_bytes_and_fit_exactly(built):
    """What `plan` and `fit --plan` say before a build is what the pack holds (wo_a's slices included)."""
    src, pack = built
    cfg = Checkpoint.open(src).config
    saved = Plan.load(plan_files(pack.with_name("pack.work"), pack)[0])
    plan = make_plan(cfg, saved.k, saved.codebook, saved.profile)
    totals = Manifest.load(pack).totals
    assert {c: plan.expected_bytes.get(c) for c in totals} == {c: t["bytes"] for c, t in totals.items()}
    for sparks in (1, 2):
        before = fit(cfg, pack_spec(cfg, plan).tensors, FitTarget(sparks, 4096))
        after = fit(cfg, stored_from_pack(pack)[1], FitTarget(sparks, 4096))
        assert [r.weights_gib for r in before.ranks] == [r.weights_gib for r in after.ranks]


def test_the_k_map_and_bits_read_from_the_trellis_shapes_are_the_plans(built):
    """What bench/converter_curve.py reads from packs without a manifest (exllamav3's converter's)."""
    src, pack = built
    cfg = Checkpoint.open(src).config
    plan = Plan.load(plan_files(pack.with_name("pack.work"), pack)[0])
    assert stored_k(pack, cfg) == {key: (None if k is None else float(k)) for key, k in plan.k.items()}
    assert stored_bpw(pack, cfg) == pytest.approx(plan.achieved_bpw, rel=1e-12)
    budgeted = {t.key for t in targets(cfg) if t.budgeted}
    spec = pack_spec(cfg, make_plan(cfg, plan.k, plan.codebook, plan.profile)).tensors
    assert budgeted_bytes(pack) == sum(t.nbytes for t in spec if t.linear and t.linear.split(".slice.")[0] in budgeted)
