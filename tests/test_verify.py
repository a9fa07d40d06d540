"""verify: a clean pack passes; a flipped byte, a truncated, deleted or stray shard, a tampered index and a
misaligned tensor each fail with the file named; no manifest is unusable input (exit 2). The pack owns
exactly the files its manifest names: the source's tokenizer, generation and licence files are copied
and recorded with their sha256 (nothing else of the source folder is), and an edited one, a stray file or
a symbolic link is a fault."""

from __future__ import annotations

import json
import shutil

import pytest
from one_line import one_line

from quantizer.checkpoint.safetensors_file import PlannedTensor, read_header, read_tensor, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.cli import main
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.pack.manifest import K_MAP_NAME, MANIFEST_NAME, Manifest, sha256_file
from quantizer.pack.owned import owned_files

CAP = "4M"


@pytest.fixture(scope="module")
def pack(tiny_v41, tmp_path_factory):
    """A pack with fp16 (K 16) attention linears and native everything else: no encoding, so it is instant."""
    root = tmp_path_factory.mktemp("verify")
    cfg = Checkpoint.open(tiny_v41).config
    plan = make_plan(cfg, {t.key: (16.0 if t.key.startswith("layers.0.attn.") else None) for t in targets(cfg)})
    plan.save(root / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--shard-size", CAP, "--no-calibrate"]) == 0
    return root / "pack"


@pytest.fixture
def copy(pack, tmp_path):
    return shutil.copytree(pack, tmp_path / "pack")


def _shards(pack):
    return [s["file"] for s in json.loads((pack / MANIFEST_NAME).read_text())["shards"]]


def _verify(pack, capsys, *flags):
    code = main(["verify", str(pack), *flags])
    return code, capsys.readouterr().out


def test_a_clean_pack_verifies_at_header_level_and_in_full(pack, capsys):
    for flags in ((), ("--full",)):
        code, out = _verify(pack, capsys, *flags)
        assert code == 0 and "FAULT" not in out and out.rstrip().endswith("clean")


def test_one_flipped_byte_fails_full_verify_naming_the_shard(copy, capsys):
    shard = copy / _shards(copy)[2]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    assert _verify(copy, capsys)[0] == 0  # headers, sizes and alignment are intact: only a hash can tell
    code, out = _verify(copy, capsys, "--full")
    assert code == 1 and f"FAULT {shard.name}: sha256" in out


def test_a_truncated_shard_fails_naming_it(copy, capsys):
    shard = copy / _shards(copy)[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    code, out = _verify(copy, capsys)
    assert code == 1 and f"FAULT {shard.name}: " in out and "truncated" in out


def test_a_deleted_shard_fails_naming_it(copy, capsys):
    name = _shards(copy)[0]
    (copy / name).unlink()
    code, out = _verify(copy, capsys)
    assert code == 1 and f"FAULT {name}: missing" in out


def test_a_stray_shard_fails_because_loaders_would_read_it(copy, capsys):
    shutil.copyfile(copy / _shards(copy)[0], copy / "model-extra.safetensors")
    code, out = _verify(copy, capsys)
    assert code == 1 and "FAULT model-extra.safetensors: shard not in the manifest" in out


def test_a_tampered_index_fails_naming_the_tensor(copy, capsys):
    index = json.loads((copy / INDEX_NAME).read_text())
    dropped = "layers.3.ffn.gate.bias_vl"
    moved = "embed.weight"
    del index["weight_map"][dropped]
    index["weight_map"][moved] = _shards(copy)[-1]
    (copy / INDEX_NAME).write_text(json.dumps(index))
    code, out = _verify(copy, capsys)
    assert code == 1
    assert f"FAULT {INDEX_NAME}: does not name {dropped}" in out
    assert f"FAULT {INDEX_NAME}: maps {moved} to {_shards(copy)[-1]}, which does not hold it" in out


def _rewrite_shard(pack, name, align, drop=()):
    """Rewrite one shard (optionally without some tensors) and make the manifest and index agree with it,
    as a writer with that bug would have."""
    header = read_header(pack / name)
    tensors = [PlannedTensor(n, e.dtype, e.shape, read_tensor(e)) for n, e in header.tensors.items()
               if not n.startswith("__align_pad__") and n not in drop]
    write_safetensors(pack / name, tensors, metadata=header.metadata, align=align)
    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    for s in manifest["shards"]:
        if s["file"] == name:
            s["bytes"], s["sha256"] = (pack / name).stat().st_size, sha256_file(pack / name)
    for n in drop:
        del manifest["tensors"][n]
    index = json.loads((pack / INDEX_NAME).read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n not in drop}
    index["metadata"]["total_size"] -= sum(header.tensors[n].nbytes for n in drop)
    (pack / INDEX_NAME).write_text(json.dumps(index))
    manifest["files"][INDEX_NAME] = {"bytes": (pack / INDEX_NAME).stat().st_size, "sha256": sha256_file(pack / INDEX_NAME)}
    _write_sealed(pack, manifest)


def _write_sealed(pack, manifest: dict) -> None:
    """The manifest as that writer would write it: with the digest of what it claims."""
    (pack / MANIFEST_NAME).write_text(json.dumps(Manifest.from_dict(manifest, "edited").to_dict()))


def test_a_misaligned_tensor_fails_even_when_the_manifest_agrees(copy, capsys):
    name = _shards(copy)[1]
    _rewrite_shard(copy, name, align=1)
    code, out = _verify(copy, capsys, "--full")
    assert code == 1 and f"FAULT {name}: " in out and "not 64-byte aligned" in out


def test_a_dropped_source_tensor_fails_even_when_manifest_and_index_agree(copy, capsys):
    dropped = "layers.3.ffn.gate.bias_vl"
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    _rewrite_shard(copy, manifest["tensors"][dropped]["shard"], align=64, drop=(dropped,))
    code, out = _verify(copy, capsys, "--full")
    assert code == 1 and f"FAULT {dropped}: source tensor (native) is not in the pack" in out
    assert f"FAULT {dropped}: missing (" in out  # and the pack spec of its K map has it
    assert out.count("FAULT") == 2


def test_a_tensor_dropped_from_shard_manifest_index_and_sources_is_caught_by_the_pack_spec(copy, capsys):
    dropped = "layers.3.ffn.gate.bias_vl"
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    _rewrite_shard(copy, manifest["tensors"][dropped]["shard"], align=64, drop=(dropped,))
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    del manifest["sources"][dropped]
    _write_sealed(copy, manifest)
    code, out = _verify(copy, capsys)
    assert code == 1 and f"FAULT {dropped}: missing (F32[" in out and out.count("FAULT") == 1


def test_a_manifest_for_an_unknown_loader_profile_is_one_line(copy, capsys):
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["plan"]["loader"] = "bogus"
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["verify", str(copy)]) == 2
    one_line(capsys.readouterr().err, f"{copy / MANIFEST_NAME}: made for loader profile 'bogus'")


def test_a_directory_without_a_manifest_is_unusable_input(tiny_v41, capsys):
    assert main(["verify", str(tiny_v41)]) == 2
    assert "no manifest" in capsys.readouterr().err


@pytest.fixture(scope="module")
def side_pack(tiny_v41, tmp_path_factory):
    """A pack of a source folder that also holds a tokenizer (linked, as in a Hugging Face snapshot), a
    generation config, a licence and files of the user's that are no part of any model."""
    root = tmp_path_factory.mktemp("side")
    src = shutil.copytree(tiny_v41, root / "src")
    (root / "blob").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (src / "tokenizer.json").symlink_to(root / "blob")
    (src / "generation_config.json").write_text('{"bos_token_id": 0}')
    (src / "LICENSE").write_text("MIT License")
    (src / "notes.txt").write_text("my notes")
    (src / "convert.py").write_text("print('hello')")
    (src / "README.md").write_text("# the source's own card")
    cfg = Checkpoint.open(src).config
    make_plan(cfg, {t.key: None for t in targets(cfg)}).save(root / "plan.json")
    assert main(["build", str(src), "--plan", str(root / "plan.json"), "--out", str(root / "pack"), "--shard-size", CAP,
                 "--no-calibrate"]) == 0
    return root


def test_the_pack_copies_and_records_only_the_sources_tokenizer_generation_and_licence_files(side_pack, capsys):
    pack, src = side_pack / "pack", side_pack / "src"
    manifest = Manifest.load(pack)
    assert sorted(manifest.files) == ["LICENSE", "config.json", "generation_config.json", K_MAP_NAME, INDEX_NAME,
                                      "quantization_config.json", "tokenizer.json"]
    assert sorted(p.name for p in pack.iterdir()) == owned_files(manifest)  # no notes.txt, convert.py
    for name in ("LICENSE", "generation_config.json", "tokenizer.json"):
        assert not (pack / name).is_symlink() and (pack / name).read_bytes() == (src / name).read_bytes()
    for name, record in manifest.files.items():
        assert (record.bytes, record.sha256) == ((pack / name).stat().st_size, sha256_file(pack / name))
    assert "# the source's own card" not in (pack / "README.md").read_text()
    assert _verify(pack, capsys)[0] == 0


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "quantization_config.json", INDEX_NAME, "LICENSE",
                                  K_MAP_NAME])
def test_an_edited_file_of_the_pack_is_a_fault_naming_it(side_pack, tmp_path, capsys, name):
    pack = shutil.copytree(side_pack / "pack", tmp_path / "pack")
    path = pack / name
    path.write_bytes(path.read_bytes().replace(b"1", b"2", 1) if b"1" in path.read_bytes() else path.read_bytes() + b" ")
    code, out = _verify(pack, capsys)
    assert code == 1 and f"FAULT {name}: not the file the pack stage wrote" in out
    path.unlink()
    code, out = _verify(pack, capsys)
    assert code == 1 and f"FAULT {name}: missing; the pack stage wrote it" in out


def test_strays_and_links_in_a_pack_are_faults_naming_them(copy, tmp_path, capsys):
    (copy / "notes.txt").write_text("my notes")
    (copy / "README.md.tmp").write_text("half a card")
    (copy / "passwd.txt").symlink_to(tmp_path / "outside.txt")  # dangling or not, a link is a fault
    (copy / "subdir").mkdir()
    (copy / ".cache").mkdir()  # hidden: huggingface_hub's upload records, not part of the pack
    code, out = _verify(copy, capsys)
    assert code == 1
    for name, what in (("notes.txt", "file"), ("README.md.tmp", "file"), ("subdir", "directory")):
        assert f"FAULT {name}: a {what} the manifest does not name; not part of the pack" in out
    assert "FAULT passwd.txt: a symbolic link" in out and ".cache" not in out
    assert out.count("FAULT") == 4
