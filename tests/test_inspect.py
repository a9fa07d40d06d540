"""inspect: the class table of the real V4.1-Flash layout, and problems found in broken checkpoints."""

from __future__ import annotations

import json
import shutil

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.inventory.classify import take_inventory

# docs/deepseek-v4-layout.md: (tensors, params, bytes) per class of V4.1-Flash
V41_CLASSES = {
    "routed_expert": (92_160, 543_581_798_400, 288_777_830_400),
    "shared_expert": (240, 1_415_577_600, 1_416_960_000),
    "attention": (520, 5_064_696_320, 5_069_721_600),
    "compressor": (11, 18_352_128, 36_704_256),
    "indexer": (32, 43_516_416, 45_130_752),
    "router": (120, 78_673_920, 157_409_280),
    "mhc": (240, 39_323_760, 157_295_040),
    "norm": (80, 409_600, 819_200),
    "embed": (1, 661_913_600, 1_323_827_200),
    "head": (2, 661_918_720, 1_323_837_440),
    "engram_resident": (8, 314_654_720, 315_043_840),
    "engram_table": (4, 196_613_849_600, 202_758_032_400),
    "dspark_drafter": (2_401, 14_225_362_530, 7_932_874_632),
    "vision": (266, 485_268_480, 970_536_960),
}


def test_full_size_v41_layout_matches_the_architecture_reference(full_v41):
    inv = take_inventory(Checkpoint.open(full_v41))
    assert (inv.tensors, inv.params, inv.bytes) == (96_085, 763_205_315_794, 510_286_023_000)
    assert {c.cls: (c.tensors, c.params, c.bytes) for c in inv.classes} == V41_CLASSES
    assert (inv.routed_layers, inv.routed_experts_per_layer) == (40, 384)
    assert inv.problems == []
    shards = sorted(p.name for p in full_v41.glob("*.safetensors"))
    assert len(shards) == 48
    disk = sum(p.stat().st_blocks * 512 for p in full_v41.glob("*.safetensors"))
    assert disk < 100 << 20, "sparse layout must not use disk for tensor data"


def test_engram_tables_sit_in_the_last_two_shards(full_v41):
    index = json.loads((full_v41 / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["layers.1.engram.embed.weight"] == "model-00047-of-00048.safetensors"
    assert index["layers.14.engram.embed.weight"] == "model-00048-of-00048.safetensors"
    assert index["layers.14.engram.wkv.weight"] == "model-00048-of-00048.safetensors"


def test_tiny_checkpoints_are_consistent(tiny_v4, tiny_v41):
    for ck_dir, n in ((tiny_v4, 735), (tiny_v41, 990)):
        inv = take_inventory(Checkpoint.open(ck_dir))
        assert inv.tensors == n and inv.problems == []


def test_inspect_reports_missing_and_unexplained_tensors(tiny_v41, tmp_path, capsys):
    from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors

    ck_dir = tmp_path / "ck"
    shutil.copytree(tiny_v41, ck_dir)
    index_path = ck_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ck_dir / index["weight_map"]["norm.weight"]
    header = read_header(shard)
    kept = [planned(n, read_tensor(e), e.dtype) for n, e in header.tensors.items() if n != "layers.0.attn_norm.weight"]
    kept.append(planned("layers.0.attn.extra_bias", read_tensor(header.tensors["norm.weight"]), "BF16"))
    write_safetensors(shard, kept, align=1)
    del index["weight_map"]["layers.0.attn_norm.weight"]
    index["weight_map"]["layers.0.attn.extra_bias"] = shard.name
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))

    assert main(["inspect", str(ck_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("missing, e.g. layers.0.attn_norm.weight" in p for p in report["problems"])
    assert any("does not explain, e.g. layers.0.attn.extra_bias" in p for p in report["problems"])
    assert any("total_size" in p for p in report["problems"])
