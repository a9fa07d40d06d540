"""One Spark: packs for native ExLlamaV3's V4.1 loader (loader profile exllamav3-v41; docs/loader-profiles.md,
docs/gb10-memory.md): K1 routed experts, mmap-ready shards, the fit that tells copied from mapped weights,
cold experts written as the launch setting the recipe's launcher reads, and the refusals."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from one_line import one_line
from script_module import script_module

from quantizer.orchestrate.summary import export_line
from quantizer.checkpoint.safetensors_file import PAD_PREFIX, read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.loader_profiles import DEFAULT_OVERLAY, EXLLAMAV3_V41, Overlay, load_profile
from quantizer.contract.pack_spec import StoredTensor, pack_spec
from quantizer.contract.plan import Plan
from quantizer.fit.cold_experts import place_cold_experts, routed_tokens
from quantizer.fit.hardware import GIB, load_hardware
from quantizer.fit.launch import LAUNCH_FILE, Launch, read_launch
from quantizer.fit.memory import FitOptions, FitTarget, Scenario, evaluate, fit
from quantizer.fit.residency import split_mapped
from quantizer.model.targets import DRAFT, ROUTED, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE, classify
from quantizer.pack.manifest import Manifest, sha256_file
from quantizer.pack.owned import owned_files
from quantizer.plan.sensitivity import synthetic_summary
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import shipped

MIB = 1 << 20
V41_ENGINE = "exllamav3-v41"
BENCH = Path(__file__).resolve().parents[1] / "bench" / "one_spark_fit.py"


COLD_CONTEXT = 4096
MMAP_FLOOR = 1024  # EXL3_ATS_MMAP_MIN lowered from the engine's 1 MiB: no tensor of the small model reaches 1 MiB


@pytest.fixture(scope="module")
def one_spark_pack(tmp_path_factory):
    """The bundled small V4.1 model at 1.6 bits per routed weight: planned by our allocator on a synthetic
    summary (`plan --synthetic`), everything but the routed experts in source form (the overlay is checked on
    its plan: building it too would double the encoding time CI pays). Built with a short calibration for one
    Spark at 4,096 tokens with --cold-share 0.5 on a hardware profile (`small_spark`) whose Spark holds the
    copied pack less half its routed experts and whose mapping floor is 1 KiB: so cold experts are placed and
    written into launch.env, as on the real model's 1 MiB experts."""
    root = tmp_path_factory.mktemp("one-spark")
    src = shipped("small_model")
    assert main(["plan", str(src), "--synthetic", "--loader", EXLLAMAV3_V41, "--bpw", "1.6",
                 "--out", str(root / "plan.json")]) == 0
    plan = Plan.load(root / "plan.json")
    hardware = small_spark(Checkpoint.open(src).config, plan, root / "small-spark.json")
    assert main(["build", str(src), "--plan", str(root / "plan.json"), "--sparks", "1", "--context", str(COLD_CONTEXT),
                 "--cold-share", "0.5", "--margin", "0", "--hardware", str(hardware), "--calib-rows", "2",
                 "--calib-cols", "256", "--out", str(root / "pack")]) == 0
    return root / "pack", plan, hardware


def small_spark(cfg, plan: Plan, path: Path) -> Path:
    """A GB10 profile shrunk so that the plan's pack fits one Spark at COLD_CONTEXT tokens only with about half of
    its routed experts' bytes left in the page cache, and with the mapping floor at MMAP_FLOOR; written to `path`."""
    data = json.loads(shipped("configs", "hardware", "gb10.json").read_text())
    for term in ("worker_shortfall_gib", "os_reserve_gib", "guard_gib", "engram_cache_rows_per_table"):
        data[term]["value"] = 0
    engine = data["engines"][V41_ENGINE]
    engine["runtime"], engine["prefill"]["fixed_gib"] = [], 0.0
    engine["mapped"]["min_bytes"] = MMAP_FLOOR
    path.write_text(json.dumps(data))
    stored = pack_spec(cfg, plan).tensors
    hot = Scenario(sparks=1, context=COLD_CONTEXT, engine=V41_ENGINE, drafter="off")
    free = evaluate(cfg, stored, hot, load_hardware(path))[0].free_gib
    routed = sum(t.nbytes for t in stored if t.cls == "routed_expert" and t.name.endswith(".trellis"))
    data["visible_gib"]["value"] -= free + 0.5 * routed / GIB
    path.write_text(json.dumps(data))
    return path


def test_the_pack_has_k1_experts_aligned_shards_engram_and_tokenizer_inside_and_verifies(one_spark_pack, capsys):
    pack, plan, _ = one_spark_pack
    routed = [k for k, t in _targets(pack).items() if t.group == ROUTED]
    assert sum(plan.k[k] == 1.0 for k in routed) > len(routed) // 4  # K1 where the allocator finds it cheapest
    assert {plan.k[k] for k in routed} <= {1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0}
    for shard in sorted(pack.glob("*.safetensors")):
        for name, e in read_header(shard).tensors.items():
            if name.startswith(PAD_PREFIX):
                continue
            if e.nbytes >= MIB:  # what the loader may serve from the mapping
                assert e.offset % 64 == 0, name
            if name.endswith(".trellis"):
                assert e.offset % 16 == 0, name
    held = {n: s for s in pack.glob("*.safetensors") for n in read_header(s).tensors}
    assert [n for n in held if classify(n).cls == ENGRAM_TABLE]  # the tables are in the pack directory itself
    assert (pack / "tokenizer.json").read_bytes() == (shipped("small_model") / "tokenizer.json").read_bytes()
    config = json.loads((pack / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    capsys.readouterr()
    assert main(["verify", str(pack), "--full"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("clean") and "loader exllamav3-v41" in out and "launch.env: copy pattern" in out


def test_the_overlay_is_exl3_at_its_own_k_and_the_rest_stays_source_form(tmp_path):
    src = shipped("small_model")
    tmap = {t.key: t for t in targets(Checkpoint.open(src).config)}
    # `--overlay` alone takes the head at --head-bits (6), unless it is native (docs/decode-speed.md, the head)
    for flags, head in (([], 6.0), (["--overlay-bits", "6", "--drafter-bits", "3"], 6.0), (["--head-bits", "native"], None),
                        (["attention,head", "--head-bits", "8"], 8.0)):
        assert main(["plan", str(src), "--synthetic", "--loader", EXLLAMAV3_V41, "--bpw", "1.6", "--overlay", *flags,
                     "--out", str(tmp_path / "p.json")]) == 0
        plan = Plan.load(tmp_path / "p.json")
        side = 6.0 if "6" in flags else 5.0
        for key, t in tmap.items():
            if t.group == "routed":
                assert plan.k[key] is not None, key
            elif t.group == "head":
                assert plan.k[key] == head
            elif flags and flags[0] == "attention,head":
                assert plan.k[key] == (5.0 if t.group == "attention" else None), key  # only what was named
            elif t.group == DRAFT:
                assert plan.k[key] == (3.0 if "3" in flags else 4.0), key
            else:
                assert plan.k[key] == side, key


def test_the_pack_launches_its_cold_experts_from_the_page_cache_at_its_context_without_its_drafter(
        one_spark_pack, capsys):
    pack, _, hardware = one_spark_pack
    launch = Manifest.load(pack).plan["launch"]
    assert launch["cold_experts"] > 0 and 0 < launch["cold_share"] <= 0.5 and not launch["drafter"]
    assert (launch["context"], launch["chunk"]) == (COLD_CONTEXT, 2048)
    found = read_launch(pack)
    assert (found.drafter, found.context, found.chunk, found.mmap_min) == (False, COLD_CONTEXT, 2048, MMAP_FLOOR)
    assert found.copy_pattern.startswith(r"^(?!mtp\.|layers\.")  # the drafter's and the cold experts' names
    copy = re.compile(found.copy_pattern)
    experts = {f"layers.{t.layer}.ffn.experts.{t.expert}" for t in _targets(pack).values() if t.group == ROUTED}
    cold = {e for e in experts if not copy.search(f"{e}.w1.trellis")}
    assert len(cold) == launch["cold_experts"] and copy.search("layers.0.attn.wq_a.weight")
    # fit reads the pack's own launch settings: its context, its floor, the cold experts mapped, no drafter
    capsys.readouterr()
    assert main(["fit", str(pack), "--sparks", "1", "--hardware", str(hardware), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rank = data["ranks"][0]
    assert data["context"] == COLD_CONTEXT and data["drafter"] == "off" and data["fits"]
    assert set(rank["mapped_by_class_gib"]) == {"routed_expert"} and rank["mapped_gib"] > 0
    card = (pack / "README.md").read_text()
    assert "## Run it\n" in card and "on one DGX Spark" in card and "`DRAFT=0`" in card
    assert "set -a; . ./launch.env; set +a" in card and "library_name" not in card.split("\n---\n")[0]


def test_fit_ppl_and_card_work_on_the_pack(one_spark_pack, tmp_path, capsys):
    pack, _, _ = one_spark_pack
    capsys.readouterr()
    assert main(["fit", str(pack), "--sparks", "1", "--context", "64K", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == V41_ENGINE and data["mapped"] and data["drafter"] == "off"  # as its launch.env says
    assert main(["fit", str(pack), "--sparks", "2"]) == 2  # the engine is TP1
    assert "the exllamav3-v41 engine runs on 1 Spark(s) only" in capsys.readouterr().err
    assert main(["ppl", str(pack), "--against", str(shipped("small_model")), "--text", "heldout", "--rows", "1",
                 "--cols", "64"]) == 0
    assert "KL" in capsys.readouterr().out
    copy = shutil.copytree(pack, tmp_path / "pack")
    (copy / "README.md").unlink()
    assert main(["card", str(copy)]) == 0 and (copy / "README.md").read_text() == (pack / "README.md").read_text()


def test_a_launch_file_edited_by_hand_is_a_fault(one_spark_pack, tmp_path, capsys):
    pack = shutil.copytree(one_spark_pack[0], tmp_path / "pack")
    launch = pack / LAUNCH_FILE
    launch.write_text(launch.read_text().replace("DRAFT=0", "DRAFT=1"))
    capsys.readouterr()
    assert main(["verify", str(pack)]) == 1
    out = capsys.readouterr().out
    assert "FAULT launch.env: DRAFT=1, but the pack's drafter is in source form" in out
    assert "FAULT launch.env: not the file the pack stage wrote" in out  # its recorded sha256 (pack/owned.py)
    for command in (["fit", str(pack), "--sparks", "1"],
                    ["ppl", str(pack), "--text", "heldout", "--rows", "1", "--cols", "16"]):
        assert main(command) == 2  # nothing that reads the pack uses the edited file (issue 60)
        one_line(capsys.readouterr().err, f"{launch}: not the file the pack stage wrote", "verify --full")
    launch.unlink()
    assert main(["fit", str(pack), "--sparks", "1"]) == 2  # no fall back past a missing one
    one_line(capsys.readouterr().err, f"{launch}: missing")


def test_the_launch_file_is_a_file_the_pack_owns_and_publishes(one_spark_pack):
    pack = one_spark_pack[0]
    record = Manifest.load(pack).files[LAUNCH_FILE]
    assert (record.bytes, record.sha256) == ((pack / LAUNCH_FILE).stat().st_size, sha256_file(pack / LAUNCH_FILE))
    assert LAUNCH_FILE in owned_files(Manifest.load(pack))


def test_the_printed_export_line_loads_launch_env_from_any_pack_path(one_spark_pack, tmp_path):
    """The line the build prints quotes the pack path: one with a space and `$(...)` exports the settings
    and runs nothing (issue 60)."""
    pack = tmp_path / "my packs $(touch ran)"
    shutil.copytree(one_spark_pack[0], pack)
    line = export_line(pack / LAUNCH_FILE)
    env = subprocess.run(["bash", "-c", f"{line}; env"], capture_output=True, text=True, cwd=tmp_path, check=True)
    settings, exported = read_launch(pack), env.stdout.splitlines()
    assert f"CTX={settings.context}" in exported and f"EXL3_ATS_COPY={settings.copy_pattern}" in exported
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_one_spark_plan_defaults_to_the_v41_loader_and_fits_512k(real_v41, capsys):
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "1", "--context", "512K"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"achieved ([\d.]+) bits per routed weight .* loader profile exllamav3-v41", out)
    assert m and 1.4 <= float(m[1]) <= 1.8, out[:400]  # bits per routed weight: the only budgeted tensors
    assert "FITS: fits 1 Spark (exllamav3-v41" in out
    assert "drafter off" in out  # a source-form drafter would be dequantized into GPU memory: launched without


def test_tensorfold_on_one_spark_is_refused_in_one_line(capsys):
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "1", "--loader", "tensorfold"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the tensorfold engine runs on 2 or 4 Spark(s) only" in err
    assert "use --loader vllm-exl3 or exllamav3-v41 for 1 Spark(s)" in err


@pytest.mark.parametrize("flags, message", [
    (["--overlay", "--overlay-bits", "2.5"], "K 2.5 is a half rate, but DSV4 attention takes integer K only"),
    (["--overlay", "--overlay-bits", "9"], "--overlay-bits: K 9 is not an EXL3 rate"),
    (["--overlay", "--overlay-bits", "16"], "overlay K 16: the exllamav3-v41 engine loads K 1..8"),
    (["--overlay", "routed"], "--overlay routed: not a group the exllamav3-v41 engine takes as an overlay (always EXL3"),
    (["--overlay", "embed"], "--overlay embed: not a group the exllamav3-v41 engine takes as an overlay (kept in source"),
    (["--overlay-bits", "4"], "--overlay-bits sets the overlay's K; add --overlay"),
    (["--drafter-bits", "4"], "keeps the drafter in source form unless --overlay names it"),
    (["--overlay", "attention", "--drafter-bits", "3"], "leaves the drafter in source form; add drafter to --overlay"),
    (["--overlay", "--loader", "vllm-exl3"], "--overlay: the vllm-exl3 engine reads every group in one form"),
    (["--cold-share", "1.5"], "--cold-share 1.5: a share of the routed tokens, at least 0 and below 1"),
    (["--cold-share", "0.1", "--bpw", "1.6"], "--cold-share picks cold experts by the calibration's routing"),
])
def test_a_bad_one_spark_request_gets_one_line_and_exit_2(flags, message, capsys):
    args = ["plan", "--model-config", "small-v41", "--sparks", "1", "--context", "64K"]
    args += flags if "--bpw" in flags else ["--bpw", "1.6", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_fit_json_states_copied_weights_and_mapped_ones(capsys):
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--loader", EXLLAMAV3_V41, "--bpw", "1.59",
                 "--overlay", "--sparks", "1", "--context", "6144", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rank = data["ranks"][0]
    # routed experts at 1.59 bits (101.4 GiB; one K per layer, so up to one layer's step of 1.6 GiB under) and the
    # K5 attention side are copied; the K4 drafter is mapped
    assert 106 < rank["weights_gib"] < 109.5 and 6 < rank["mapped_gib"] < 7.5 and data["mapped"]
    assert rank["kv_pool_gib"] == pytest.approx(6144 * (3200 + 3072) / GIB)  # DSA pools + the drafter's layers


def test_source_form_linears_are_dequantized_and_only_large_aligned_tensors_are_mapped():
    serving = load_hardware().engine(V41_ENGINE).mapped
    t = [
        StoredTensor("layers.0.attn.wq_a.weight", 4 * MIB, (2048, 2048), "F8_E4M3", "attention", "native", None, None),
        StoredTensor("layers.0.attn.wq_a.scale", 4096, (64, 64), "F8_E8M0", "attention", "native", None, None),
        StoredTensor("mtp.0.ffn.experts.0.w1.weight", 2 * MIB, (2048, 1024), "I8", "dspark_drafter", "native", None, None),
        StoredTensor("mtp.0.ffn.experts.0.w1.scale", 65536, (2048, 32), "F8_E8M0", "dspark_drafter", "native", None, None),
        StoredTensor("layers.1.ffn.experts.3.w1.trellis", 2 * MIB, (16, 16, 4096), "I16", "routed_expert", "exl3",
                     1.0, "layers.1.ffn.experts.3.w1", offset=4096),
        StoredTensor("layers.1.ffn.experts.4.w1.trellis", 2 * MIB, (16, 16, 4096), "I16", "routed_expert", "exl3",
                     1.0, "layers.1.ffn.experts.4.w1", offset=4104),  # off the 16-byte grid
        StoredTensor("mtp.0.attn.wq_a.trellis", 2 * MIB, (16, 16, 4096), "I16", "dspark_drafter", "exl3", 4.0,
                     "mtp.0.attn.wq_a"),
        StoredTensor("embed.weight", 2 * MIB, (1024, 1024), "BF16", "embed", "native", None, None),
        StoredTensor("layers.0.attn.wq_a.suh", 4096, (2048,), "F16", "attention", "exl3", 4.0, "layers.0.attn.wq_a"),
        # read as stored by their modules (an Embedding's BF16, a hyper-connection's F32 mixer), so mappable
        StoredTensor("mtp.2.markov_head.embed.weight", 63 * MIB, (129280, 256), "BF16", "dspark_drafter", "native",
                     None, None),
        StoredTensor("mtp.2.hc_attn_fn", 2 * MIB, (24, 20480), "F32", "dspark_drafter", "native", None, None),
        StoredTensor("mtp.2.markov_head.head.weight", 63 * MIB, (129280, 256), "BF16", "dspark_drafter", "native",
                     None, None),  # a Linear's BF16: converted to FP16, so copied
    ]
    copied, mapped = split_mapped(t, serving, serving.copy_default)
    by_name = {c.name: c for c in copied}
    assert by_name["layers.0.attn.wq_a.weight"].nbytes == 2 * 2048 * 2048  # FP8 -> FP16
    assert by_name["mtp.0.ffn.experts.0.w1.weight"].nbytes == 2 * 2048 * 2048  # packed FP4 -> FP16: 4x
    assert "layers.0.attn.wq_a.scale" not in by_name  # consumed by the dequantization
    assert [m.name for m in mapped] == ["mtp.0.attn.wq_a.trellis", "mtp.2.markov_head.embed.weight",
                                        "mtp.2.hc_attn_fn"]  # the drafter: large, aligned, not matched, as stored
    assert "mtp.2.markov_head.head.weight" in by_name
    assert {"layers.1.ffn.experts.3.w1.trellis", "layers.1.ffn.experts.4.w1.trellis", "embed.weight",
            "layers.0.attn.wq_a.suh"} <= set(by_name)  # copied by the pattern, off grid, BF16, under 1 MiB
    lazy, _ = split_mapped(t, serving, serving.copy_default, fp8_lazy=True)
    assert {c.name: c.nbytes for c in lazy}["layers.0.attn.wq_a.weight"] == 4 * MIB  # kept compact


def test_cold_experts_make_more_bits_fit_within_their_routing_share(real_v41):
    hw = load_hardware()
    summary = synthetic_summary(real_v41)
    tokens = routed_tokens(summary)
    plan = uniform_plan(real_v41, 1.8, profile=load_profile(EXLLAMAV3_V41), head_bits=None, overlay=Overlay(DEFAULT_OVERLAY))
    stored = pack_spec(real_v41, plan).tensors
    s = Scenario(sparks=1, context=524_288, engine=V41_ENGINE)
    hot = min(r.free_gib for r in evaluate(real_v41, stored, s, hw))
    assert hot < 0  # 1.8 bits do not fit one Spark with every expert copied
    placed, launch = place_cold_experts(real_v41, stored, s, hw, tokens, share=0.10)
    ranks = evaluate(real_v41, stored, placed, hw)
    assert min(r.free_gib for r in ranks) >= 0 and 0 < launch.cold_share <= 0.10
    assert ranks[0].mapped_gib * GIB >= -hot * GIB  # what no longer fits is served from the mapped file
    coldest = min(tokens, key=tokens.get)
    pattern = re.compile(launch.copy_pattern)
    cold = set(launch.cold_experts)
    for expert in (coldest, *list(cold)[:50], max(tokens, key=tokens.get)):
        copied = bool(pattern.search(f"{expert}.w1.trellis"))
        assert copied == (expert not in cold), expert
    assert not pattern.search("mtp.0.attn.wq_a.trellis") and pattern.search("layers.0.attn.wq_a.trellis")
    assert not fit(real_v41, stored, FitTarget(1, 524_288, 1, V41_ENGINE)).fits  # the plain fit: every expert copied
    none, launch0 = place_cold_experts(real_v41, stored, s, hw, tokens, share=0.0)
    assert launch0.cold_experts == () and none.copy_pattern == Launch().copy_pattern
    assert (launch0.context, launch0.chunk, launch0.mmap_min) == (524_288, 2048, MIB)  # what launch.env carries
    # the margin is kept too (issue 57: the experts were placed to leave 0 GiB, 0.005 GiB free at 512K)
    kept, _ = place_cold_experts(real_v41, stored, s, hw, tokens, share=0.10, margin_gib=1.0)
    assert min(r.free_gib for r in evaluate(real_v41, stored, kept, hw)) >= 1.0 > min(r.free_gib for r in ranks)


def test_a_pack_without_a_drafter_overlay_launches_without_it(real_v41):
    plan = uniform_plan(real_v41, 1.4, profile=load_profile(EXLLAMAV3_V41), head_bits=None)
    assert all(plan.k[t.key] is None for t in targets(real_v41) if t.group == DRAFT)
    assert "DRAFT=0" in Launch(drafter=False).render()
    stored, one = pack_spec(real_v41, plan).tensors, FitTarget(1, 8192, 1, V41_ENGINE)
    copied_on = fit(real_v41, stored, one).ranks[0]
    copied_off = fit(real_v41, stored, one, FitOptions(drafter="off")).ranks[0]
    # dequantized to FP16, the MXFP4 drafter experts take four times their bytes in GPU memory
    assert copied_on.weights_by_class_gib["dspark_drafter"] > 20 and "dspark_drafter" not in copied_off.weights_by_class_gib


def _targets(pack):
    return {t.key: t for t in targets(Checkpoint.open(pack).config)}


def test_the_one_spark_fit_is_within_a_quarter_of_the_recipes_measured_torch_alloc():
    # bench/one_spark_fit.py: our CUDA charge for the recipe's 1.59 bpw overlay pack over the torch_alloc it
    # measured on a Spark at 6,144 and 262,144 tokens
    with script_module(BENCH) as bench:
        rows = bench.rows()
    assert [r["context"] for r in rows] == [6_144, 262_144]
    assert all(0.75 <= r["ratio"] <= 1.25 for r in rows), rows
    assert rows[1]["estimate_gib"] - rows[0]["estimate_gib"] == pytest.approx(1.50, abs=0.05)  # 6,272 B/token


@pytest.mark.parametrize("rate", [["--sparks", "1"], ["--bpw", "1.6", "--loader", EXLLAMAV3_V41],
                                  ["--bpw", "1.6", "--sparks", "1"]])
def test_build_refuses_cold_experts_without_the_calibrations_routing(rate, tmp_path, capsys):
    """--cold-share goes with --sparks alone or with a --bpw (a one-Spark engine's Spark count is implied); it
    needs the calibration's routing, refused before any work when there is none."""
    assert main(["build", str(shipped("small_model")), *rate, "--cold-share", "0.05", "--no-calibrate",
                 "--method", "uniform", "--out", str(tmp_path / "p")]) == 2
    one_line(capsys.readouterr().err, "--cold-share picks cold experts by the calibration's routing")
    assert not (tmp_path / "p").exists()
    assert main(["build", str(shipped("small_model")), "--bpw", "1.6", "--cold-share", "0.05", "--no-calibrate",
                 "--out", str(tmp_path / "p")]) == 2  # vllm-exl3 runs on 1, 2 or 4 Sparks: say which
    one_line(capsys.readouterr().err, "--context, --streams and --cold-share size the fit of a Spark count: add --sparks N")


def test_a_source_without_the_tokenizer_the_engine_reads_is_refused_before_any_stage(tiny_v41, tmp_path, capsys):
    """The fork reads tokenizer.json from the pack directory, and the pack copies it from the source: a source
    without one (the tiny V4.1 checkpoint has none) was quantized for hours and then failed verify (issue 60)."""
    assert not (tiny_v41 / "tokenizer.json").exists()
    assert main(["build", str(tiny_v41), "--loader", EXLLAMAV3_V41, "--bpw", "1.6", "--method", "uniform", "--no-calibrate",
                 "--out", str(tmp_path / "p")]) == 2
    one_line(capsys.readouterr().err, "no tokenizer.json, which the exllamav3-v41 engine reads from the pack directory")
    assert list(tmp_path.iterdir()) == []


def test_every_rule_a_profile_sets_names_the_engine_code_it_comes_from():
    from quantizer.contract.loader_profiles import loader_names, RULES, load_profile

    for name in loader_names():
        profile = load_profile(name)
        for rule in RULES:
            if rule in ("architectures", "required_files") and not getattr(profile, rule):
                continue  # not a rule of this profile
            assert profile.sources.get(rule), (name, rule)
    assert load_profile(EXLLAMAV3_V41).ignored.keys() == {"model.safetensors.index.json", "quantization_config"}
