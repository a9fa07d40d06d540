"""Packs the V4.1 engines load as shipped (docs/loader-profiles.md), built from the bundled small V4.1
checkpoint (native FP8 / MXFP4 like the real one):

- vllm-exl3: non-routed and `mtp.*` tensors byte-identical to the source, routed experts EXL3 with K
  per expert (one tensor group and one codebook marker each), config.json carrying the engine's
  quantization_config, the Engram tables in the pack and in its index;
- tensorfold: no F8 tensor in the model directory, every linear EXL3 mul1, plain tensors in the dtypes
  its loader converts, the Engram tables in a sibling directory of the source's shards.

verify passes both and, on a hand-broken copy of each, names the rule and the engine file behind it.
The two builds share one work directory (the routed experts are encoded once).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
from one_line import one_line
from test_publish import _listed  # tests/ is on sys.path (pytest prepend import mode)

from quantizer.contract.loader_profiles import load_profile
from quantizer.checkpoint.safetensors_file import read_bytes, read_header
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.cli import main
from quantizer.contract.rules import make_plan
from quantizer.model.targets import ROUTED, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE, classify
from quantizer.pack.manifest import Manifest
from quantizer.pack.owned import owned_files
from quantizer.shipped import shipped

pytestmark = pytest.mark.slow  # builds packs of the bundled model: `make test-fast` skips it

EXL3_LEAVES = ("trellis", "suh", "svh", "mul1", "mcg")
F8 = ("F8_E4M3", "F8_E5M2", "F8_E8M0")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A copy: the tensorfold pack links the source's Engram shards."""
    return shutil.copytree(shipped("small_model"), tmp_path_factory.mktemp("src") / "small")


def routed_k(t) -> float:
    """Layer 0 all K3 (a uniform layer, sized from config's layer_bits); elsewhere K 2 or 3 by expert,
    w1 and w3 apart in odd layers (vllm-exl3 takes K2..K8 per expert and per projection)."""
    if t.layer == 0:
        return 3.0
    return 2.0 + (t.expert + (t.proj == "w3" and t.layer % 2)) % 2


@pytest.fixture(scope="module")
def packs(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    cfg = Checkpoint.open(source).config
    plans = {
        "vllm-exl3": {t.key: routed_k(t) if t.group == ROUTED else None for t in targets(cfg)},
        "tensorfold": {t.key: routed_k(t) if t.group == ROUTED else 2.0 for t in targets(cfg)},
    }
    for loader, k in plans.items():
        make_plan(cfg, k, profile=load_profile(loader)).save(root / f"{loader}.json")
        assert main(["build", str(source), "--plan", str(root / f"{loader}.json"), "--out", str(root / loader),
                     "--work", str(root / "work"), "--no-calibrate"]) == 0
    return root


def headers(pack) -> dict:
    return {name: e for f in sorted(pack.glob("*.safetensors")) for name, e in read_header(f).tensors.items()
            if not name.startswith("__align_pad__")}


def test_vllm_exl3_pack_is_the_source_with_routed_experts_in_exl3(source, packs, capsys):
    pack = packs / "vllm-exl3"
    src = Checkpoint.open(source)
    held = headers(pack)
    routed = {t.key for t in targets(src.config) if t.group == ROUTED}
    for name, entry in src.tensors.items():
        if name.rsplit(".", 1)[0] in routed:
            assert name not in held  # replaced by the expert's EXL3 group
        else:  # attention, shared experts, compressors, indexer, head, Engram, mtp.* (MXFP4 experts too)
            assert read_bytes(held[name]) == read_bytes(entry), name
            assert held[name].dtype == entry.dtype
    assert any(held[n].dtype == "I8" for n in held if n.startswith("mtp.") and ".experts." in n)
    for key in routed:
        leaves = sorted(n.rsplit(".", 1)[1] for n in held if n.rsplit(".", 1)[0] == key)
        assert leaves == ["mul1", "suh", "svh", "trellis"], key  # one group, exactly one codebook marker
    layer_1 = {held[f"layers.1.ffn.experts.{e}.w2.trellis"].shape[-1] // 16 for e in range(4)}
    assert layer_1 == {2, 3}  # K per expert inside one layer
    config = json.loads((pack / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "exl3", "bits": 3, "codebook": "mul1", "layer_bits": {"0": 3},
        "non_routed_quantization": {"quant_method": "deepseek_v4_fp8", "weight_block_size": [32, 32],
                                    "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "expert_dtype": "fp4"},
        "mtp_experts": "source", "mtp_experts_start_layer": src.config.num_layers,
    }
    index = json.loads((pack / INDEX_NAME).read_text())["weight_map"]
    every = {n: f.name for f in pack.glob("*.safetensors") for n in read_header(f).tensors}
    assert index == every  # exactly the headers: no pad tensor vLLM would hand to the model
    manifest = Manifest.load(pack)
    tables = [n for n in held if classify(n).cls == ENGRAM_TABLE]
    engram_shards = {s.file for s in manifest.shards if s.engram}
    assert tables and all(index[n] in engram_shards for n in tables)
    capsys.readouterr()
    assert main(["verify", str(pack), "--full"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("clean")
    card = (pack / "README.md").read_text()  # experts of K 2 and 3 in one layer: the plugin's per-expert path
    assert "`VLLM_EXL3_TENSOR_MIXED_K=1` in the serving container turns on, eager" in card
    assert "EAGER=1 DSPARK=0 bash scripts/serve.sh 2\n" in card  # the runbook (tests/test_card_runbook.py)
    assert "library_name" not in card.split("\n---\n")[0] and "- vllm-exl3\n" in card


def test_tensorfold_pack_has_no_f8_every_linear_exl3_and_engram_beside_it(source, packs, capsys):
    pack = packs / "tensorfold"
    src = Checkpoint.open(source)
    held = headers(pack)
    assert not [n for n, e in held.items() if e.dtype in F8]
    for t in targets(src.config):
        stored = [t.key] if t.proj != "wo_a" else [f"{t.key}.slice.{g}" for g in range(src.config.o_groups)]
        for key in stored:
            assert held[f"{key}.trellis"].dtype == "I16" and f"{key}.mul1" in held and f"{key}.mcg" not in held
    assert {"head.trellis", "mtp.0.main_proj.trellis", "layers.0.attn.wo_a.slice.1.trellis"} <= set(held)
    for name, dtype in (("layers.0.ffn.gate.weight", "F16"), ("layers.2.attn.indexer.weights_proj.weight", "F32"),
                        ("layers.1.engram.q_weight", "F32"), ("layers.1.engram.k_weight", "F32"),
                        ("layers.0.attn.attn_sink", "F32"), ("layers.0.ffn.gate.bias", "F32"),
                        ("layers.0.hc_attn_fn", "F32"), ("mtp.0.ffn.gate.weight", "F16")):
        assert held[name].dtype == dtype, name
    assert held["layers.0.attn_norm.weight"].dtype == src.tensors["layers.0.attn_norm.weight"].dtype
    assert not [n for n in held if classify(n).cls == ENGRAM_TABLE]
    engram = packs / "tensorfold-Engram"
    weight_map = json.loads((engram / INDEX_NAME).read_text())["weight_map"]
    tables = sorted(n for n in src.tensors if classify(n).cls == ENGRAM_TABLE)
    assert sorted(weight_map) == tables
    for name in tables:
        linked = engram / weight_map[name]
        assert os.stat(linked).st_ino == os.stat(src.tensors[name].path).st_ino  # a link, not a copy
    config = json.loads((pack / "config.json").read_text())
    assert config["quantization_config"]["codebook"] == "mul1" and config["quantization_config"]["head_bits"] == 2
    assert config["quantization_config"]["mtp_bits"] == 2
    capsys.readouterr()
    assert main(["verify", str(pack), "--full"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("clean")
    card = (pack / "README.md").read_text()  # the card points TensorFold at the folder beside the pack
    assert "TF_DS_ENGRAM=$HOME/models/tensorfold-Engram " in card and "2 or 4 DGX Sparks" in card
    assert "library_name" not in card.split("\n---\n")[0] and "- tensorfold\n" in card


def broken_copy(packs, tmp_path, loader: str, drop: tuple[str, str]):
    """A copy of a built pack whose config.json lacks one key (`drop`: section, key)."""
    broken = tmp_path / loader
    shutil.copytree(packs / loader, broken)
    config = json.loads((broken / "config.json").read_text())
    del config[drop[0]][drop[1]]
    (broken / "config.json").write_text(json.dumps(config))
    return broken


def test_verify_names_the_rule_and_engine_file_of_a_broken_vllm_exl3_pack(packs, tmp_path, capsys):
    broken = broken_copy(packs, tmp_path, "vllm-exl3", ("quantization_config", "non_routed_quantization"))
    capsys.readouterr()
    assert main(["verify", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAULT config.json: quantization_config has {'non_routed_quantization': None}" in out
    assert "rule quantization_config: vcruz305/vllm-exl3 src/vllm_exl3/exl3.py" in out
    # the same pack under stock exllamav3's rules: K per expert and gate/up apart are what it refuses
    assert main(["verify", str(packs / "vllm-exl3"), "--loader", "exllamav3"]) == 1
    out = capsys.readouterr().out
    assert "FAULT layers.1.ffn.experts: experts of one projection must share one K" in out
    assert "rule one_k_per_projection: exllamav3/modules/multilinear.py" in out


def test_verify_names_the_rule_and_engine_file_of_a_broken_tensorfold_pack(packs, tmp_path, capsys):
    broken = broken_copy(packs, tmp_path, "tensorfold", ("text_config", "engram_vocab_size"))
    shutil.copytree(packs / "tensorfold-Engram", tmp_path / "tensorfold-Engram")
    name = "layers.0.ffn.gate.weight"
    shard = broken / json.loads((broken / INDEX_NAME).read_text())["weight_map"][name]
    _relabel(shard, name, "F16", "BF16")  # the dtype TensorFold's loader cannot convert to f16
    capsys.readouterr()
    assert main(["verify", str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"FAULT {name}: BF16; the engine's loader reads it as F16 (loader tensorfold, rule plain_dtypes: " \
           "bertholomus/TensorFold zig/src/families/dsv41/checkpoint.zig" in out
    assert "FAULT config.json: no text_config.engram_vocab_size (loader tensorfold, rule required_config_keys: " \
           "bertholomus/TensorFold zig/src/families/dsv41/config.zig" in out
    shutil.rmtree(tmp_path / "tensorfold-Engram")
    assert main(["verify", str(broken)]) == 1
    assert "rule engram_tables: bertholomus/TensorFold zig/src/families/dsv41/engram_io.zig" in capsys.readouterr().out


def _relabel(shard, name: str, old: str, new: str) -> None:
    """Rewrite one tensor's dtype label in a shard's header in place (the padding absorbs the length)."""
    with open(shard, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        assert header[name]["dtype"] == old
        header[name]["dtype"] = new
        blob = json.dumps(header, separators=(",", ":")).encode()
        assert len(blob) <= size
        f.seek(8)
        f.write(blob + b" " * (size - len(blob)))


def test_the_engram_directory_is_owned_like_the_pack_and_publish_uploads_the_pack_alone(packs, tmp_path, capsys):
    """tensorfold: the sibling `<pack>-Engram/` holds the source's Engram shards and their index, nothing
    else and no link; publish lists the pack's own files (the tables are the source's, byte for byte)."""
    pack = shutil.copytree(packs / "tensorfold", tmp_path / "tensorfold")
    sibling = shutil.copytree(packs / "tensorfold-Engram", tmp_path / "tensorfold-Engram")
    capsys.readouterr()
    assert main(["publish", str(pack), "--repo", "example-org/tiny-tensorfold", "--dry-run"]) == 0
    assert set(_listed(capsys.readouterr().out)) == set(owned_files(Manifest.load(pack))) == {p.name for p in pack.iterdir()}
    (sibling / "notes.txt").write_text("my notes")
    (sibling / "extra.safetensors").symlink_to(next(sibling.glob("*.safetensors")))
    assert main(["verify", str(pack)]) == 1
    out = capsys.readouterr().out
    assert "FAULT tensorfold-Engram/notes.txt: a file the manifest does not name" in out
    assert "FAULT tensorfold-Engram/extra.safetensors: a symbolic link" in out and out.count("FAULT") == 2
    assert main(["publish", str(pack), "--repo", "example-org/tiny-tensorfold", "--dry-run"]) == 2
    assert "verify finds 2 fault(s)" in capsys.readouterr().err


def test_a_flipped_byte_in_an_engram_table_beside_the_pack_is_found(packs, tmp_path, capsys):
    """The sibling's shards carry the source's sha256 in the manifest: verify --full, publish --full and ppl
    find a byte flipped inside a table there (they once said clean; issue 60)."""
    pack = shutil.copytree(packs / "tensorfold", tmp_path / "tensorfold")
    sibling = shutil.copytree(packs / "tensorfold-Engram", tmp_path / "tensorfold-Engram")
    weight_map = json.loads((sibling / INDEX_NAME).read_text())["weight_map"]
    name = next(n for n in sorted(weight_map) if classify(n).cls == ENGRAM_TABLE)
    shard = sibling / weight_map[name]
    entry = read_header(shard).tensors[name]
    data = bytearray(shard.read_bytes())
    data[entry.offset + entry.nbytes // 2] ^= 0x40
    shard.write_bytes(data)
    capsys.readouterr()
    assert main(["verify", str(pack), "--full"]) == 1
    out = capsys.readouterr().out
    assert f"FAULT tensorfold-Engram/{shard.name}: sha256" in out and out.count("FAULT") == 1
    assert main(["publish", str(pack), "--repo", "example-org/tiny-tensorfold", "--dry-run", "--full"]) == 2
    one_line(capsys.readouterr().err, "verify finds 1 fault(s)", f"tensorfold-Engram/{shard.name}")
    assert main(["ppl", str(pack), "--text", "heldout", "--rows", "1", "--cols", "16"]) == 2
    one_line(capsys.readouterr().err, f"{shard}: sha256", "is not the manifest's")
    shard.write_bytes(data[:-1])  # and one cut short is found without --full
    assert main(["verify", str(pack)]) == 1
    assert f"FAULT tensorfold-Engram/{shard.name}: {len(data) - 1:,} bytes but the manifest says" in capsys.readouterr().out


def test_the_tensorfold_pack_is_measured_with_the_engram_tables_beside_it(source, packs, tmp_path, capsys,
                                                                          monkeypatch):
    """ppl --record and eval read the tables from <pack>-Engram/, as TensorFold does; without that
    directory, both name it before any forward pass."""
    pack = shutil.copytree(packs / "tensorfold", tmp_path / "tensorfold")  # --record writes into the pack
    shutil.copytree(packs / "tensorfold-Engram", tmp_path / "tensorfold-Engram")
    assert not [n for n in Checkpoint.open(pack).tensors if classify(n).cls == ENGRAM_TABLE]
    rows = ["--text", "heldout", "--rows", "2", "--cols", "64"]
    assert main(["ppl", str(pack), "--against", str(source), *rows, "--record", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    recorded = Manifest.load(pack).measurement
    assert recorded is not None and recorded.kl == pytest.approx(measured["kl"]) and measured["kl"] > 0

    pytest.importorskip("lm_eval")
    from test_eval import TASK, write_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = write_task(tmp_path / "tasks")
    assert main(["eval", str(pack), "--against", str(source), "--tasks", TASK, "--include-path", str(tasks),
                 "--limit", "4"]) == 0
    assert TASK in capsys.readouterr().out

    shutil.rmtree(tmp_path / "tensorfold-Engram")
    for argv in (["ppl", str(pack), *rows], ["eval", str(pack), "--tasks", TASK, "--include-path", str(tasks)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "tensorfold-Engram, which is missing" in err and "Traceback" not in err

