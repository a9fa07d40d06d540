"""An Engram source shard the pack can use as it is becomes a pack shard by a hard link (no copy); where
links fail it is copied, and both packs are byte-identical; a shard the pack changes is always written."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors_check import assert_safetensors_agree

from quantizer.checkpoint.safetensors_file import PlannedTensor, read_header, read_tensor, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.model.tensor_classes import ENGRAM_TABLE, classify
from quantizer.pack import shards as shards_module
from quantizer.pack.writer import PackSettings, write_pack
from quantizer.quantize import QuantizeSettings, quantize
from quantizer.verify.checks import verify_pack

FP16 = "layers.0.attn.wq_a"


@pytest.fixture
def aligned(tiny_v41, tmp_path):
    """The tiny checkpoint with each Engram table and scale in a 64-byte aligned shard of its own (the
    Engram layer's resident tensors moved to another shard), as a pack lays them out."""
    src = tmp_path / "src"
    shutil.copytree(tiny_v41, src)
    index = json.loads((src / INDEX_NAME).read_text())
    for i, path in enumerate(_engram_files(Checkpoint.open(src))):
        header = read_header(path)
        tensors = [PlannedTensor(n, e.dtype, e.shape, read_tensor(e)) for n, e in header.tensors.items()]
        table = [t for t in tensors if classify(t.name).cls == ENGRAM_TABLE]
        resident = [t for t in tensors if classify(t.name).cls != ENGRAM_TABLE]
        write_safetensors(path, table, align=64)
        write_safetensors(src / f"resident-{i}.safetensors", resident, align=1)
        index["weight_map"].update({t.name: f"resident-{i}.safetensors" for t in resident})
    (src / INDEX_NAME).write_text(json.dumps(index))
    return src


def _engram_files(ck):
    return sorted({e.path for n, e in ck.tensors.items() if classify(n).cls == ENGRAM_TABLE})


def _pack(src, tmp_path, name, wkv_k=None):
    ck = Checkpoint.open(src)
    ks = {t.key: None for t in targets(ck.config)}
    ks[FP16] = 16.0
    for t in targets(ck.config):
        if t.key.endswith("engram.wkv"):
            ks[t.key] = wkv_k
    plan = make_plan(ck.config, ks)
    work = tmp_path / f"{name}.work"
    settings = QuantizeSettings()
    quantize(ck, plan, work, settings)
    out = tmp_path / name
    write_pack(ck, plan, work, out, PackSettings(job_settings=settings.record()))
    assert_safetensors_agree(src, out)  # the hand-aligned source and the pack, read by the safetensors package too
    return ck, out


def _engram_shards(out):
    return sorted(p for p in out.glob("*.safetensors")
                  if any(classify(n).cls == ENGRAM_TABLE for n in read_header(p).tensors))


def _files(pack):
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


def test_a_reusable_engram_shard_is_hard_linked_and_the_pack_matches_a_copied_one(aligned, tmp_path, monkeypatch, capsys):
    ck, linked = _pack(aligned, tmp_path, "linked")
    sources = _engram_files(ck)
    shards = _engram_shards(linked)
    assert len(shards) == len(sources) == len(ck.config.engram_layer_ids)
    assert {p.stat().st_ino for p in shards} == {p.stat().st_ino for p in sources}  # no byte was copied
    err = capsys.readouterr().err
    assert "Engram source shard(s) reused: hard link" in err
    assert "of the source's Engram shards to link into it (copied where the filesystem refuses links)" in err
    assert not verify_pack(linked).faults

    def refuse(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(shards_module.os, "link", refuse)
    monkeypatch.setattr(shards_module.fcntl, "ioctl", refuse)
    _, copied = _pack(aligned, tmp_path, "copied")
    assert not {p.stat().st_ino for p in _engram_shards(copied)} & {p.stat().st_ino for p in sources}
    assert "reused: copy" in capsys.readouterr().err
    assert _files(linked) == _files(copied)


def test_a_source_shard_holding_more_than_the_table_is_written_not_linked(tiny_v41, tmp_path, capsys):
    ck, out = _pack(tiny_v41, tmp_path, "as-shipped", wkv_k=16.0)  # tables beside wkv, as DeepSeek ships them
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("pack: ") and "to write" in x)
    assert line.endswith(" to write") and "link" not in line  # nothing to link: no "0 B ... linked"
    assert not {p.stat().st_ino for p in _engram_shards(out)} & {p.stat().st_ino for p in _engram_files(ck)}
    assert not verify_pack(out).faults
