"""Nothing stale, nothing half-written, no hours wasted: what `build` (and `calibrate`, `ppl`) refuse up
front or survive, one case per test. Each asserts the one-line error (exit 2) or the right result,
and that nothing the user had was changed.

Builds here use a plan that stores ten attention linears as fp16 and leaves the rest native, so a
build is a few seconds of copying, not minutes of encoding.
"""

from __future__ import annotations

import errno
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from one_line import one_line

from quantizer.orchestrate.stages import plan_files
from quantizer.orchestrate.preflight import claim
from quantizer.checkpoint import fingerprint as fingerprint_module
from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.model.targets import DRAFT, targets
from quantizer.pack.manifest import Manifest
from quantizer.quantize.results import ResultStore
from quantizer.report import size_text
from quantizer.tiny.make import make_tiny
from quantizer.workdir import FINGERPRINT_CACHE, LOCK_NAME, WORK_MARKER

FP16_KEYS = [f"layers.{layer}.attn.{p}" for layer in (0, 1) for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
EXPERT = "layers.0.ffn.experts.1.w2.weight"


@pytest.fixture(scope="module")
def plan_file(tiny_v41, tmp_path_factory):
    cfg = Checkpoint.open(tiny_v41).config
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(cfg, {t.key: (16.0 if t.key in FP16_KEYS else None) for t in targets(cfg)}).save(path)
    return path


def _build(src, plan, out, *extra):
    return main(["build", str(src), "--plan", str(plan), "--out", str(out), "--no-calibrate", *extra])


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes; in a work directory, all but the lock (it names its
    last holder) and the fingerprint cache (shard hashes, kept current)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (LOCK_NAME, FINGERPRINT_CACHE)}



def _edit_header(shard: Path, edit) -> None:
    """Rewrite one shard's JSON header with `edit(header)`; the data bytes stay as they are."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _flip_byte(ck: Checkpoint, name: str) -> None:
    e = ck.entry(name)
    with open(e.path, "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        b = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([b[0] ^ 1]))


# ---- 1. a changed byte anywhere is a different source -------------------------------------------

def test_one_changed_expert_byte_refuses_the_resume(src, plan_file, tmp_path, capsys):
    out, work = tmp_path / "pack", tmp_path / "pack.work"
    assert _build(src, plan_file, out) == 0
    shutil.rmtree(out)
    kept = _snapshot(work)
    _flip_byte(Checkpoint.open(src), EXPERT)  # the middle of one expert: outside any sampled window
    capsys.readouterr()
    assert _build(src, plan_file, out) == 2
    one_line(capsys.readouterr().err, "source fingerprint differs")
    assert not out.exists() and _snapshot(work) == kept


def test_shards_are_hashed_once_and_rehashed_only_when_they_change(src, tmp_path, monkeypatch):
    calls = []
    real = fingerprint_module.sha256_file
    monkeypatch.setattr(fingerprint_module, "sha256_file", lambda p, progress=None: calls.append(p) or real(p, progress))
    monkeypatch.setattr(fingerprint_module, "_HASHED", {})
    cache = tmp_path / "source.json"
    ck = Checkpoint.open(src)
    first = source_fingerprint(ck, cache)
    assert len(calls) == len(ck.shards)
    monkeypatch.setattr(fingerprint_module, "_HASHED", {})  # a new process: only the cache remembers
    assert source_fingerprint(ck, cache) == first and len(calls) == len(ck.shards)
    _flip_byte(ck, EXPERT)
    changed = source_fingerprint(ck, cache)
    assert changed != first and calls[-1] == ck.entry(EXPERT).path and len(calls) == len(ck.shards) + 1


def test_calibration_refuses_a_changed_byte_too(src, tmp_path, capsys):
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, 4096, size=(2, 16)))
    args = ["calibrate", str(src), "--tokens", str(tokens), "--work", str(tmp_path / "w"), "--no-measure-kl"]
    assert main(args) == 0
    _flip_byte(Checkpoint.open(src), EXPERT)
    capsys.readouterr()
    assert main(args) == 2
    one_line(capsys.readouterr().err, "cannot resume a different calibration: source fingerprint differs")


# ---- 2. the pack stage: inside the lock, per-job temporary names ---------------------------------

def test_a_second_build_into_an_out_another_build_is_writing_is_refused(tiny_v41, plan_file, tmp_path, capsys):
    out = tmp_path / "pack"
    with claim(out, tmp_path / "first.work") as partial:
        (partial / "model-00001-of-00003.safetensors").write_bytes(b"the first build's shard")
        assert _build(tiny_v41, plan_file, out, "--work", str(tmp_path / "second.work")) == 2
        one_line(capsys.readouterr().err, "another build is writing this pack")
        assert (partial / "model-00001-of-00003.safetensors").read_bytes() == b"the first build's shard"
    assert not out.exists()


def test_a_pack_published_meanwhile_is_never_replaced(tiny_v41, plan_file, tmp_path, capsys, monkeypatch):
    from quantizer.pack import writer

    out = tmp_path / "pack"
    real = writer._copy_side_files

    def another_build_publishes(src, pack):
        copied = real(src, pack)
        out.mkdir()
        (out / "theirs.txt").write_text("another build's pack")
        return copied

    monkeypatch.setattr(writer, "_copy_side_files", another_build_publishes)
    assert _build(tiny_v41, plan_file, out) == 2
    one_line(capsys.readouterr().err, "appeared while this build was packing")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert not list(tmp_path.glob("pack.partial*"))  # our half pack is gone, nothing else touched


# ---- 3. a refused build changes nothing; the user's directories are left alone -------------------

def test_a_refused_rerun_keeps_plan_and_recipe(tiny_v41, plan_file, tmp_path, capsys):
    out, work = tmp_path / "pack", tmp_path / "pack.work"
    assert _build(tiny_v41, plan_file, out) == 0
    shutil.rmtree(out)
    kept = _snapshot(work)
    other = tmp_path / "other.json"
    cfg = Checkpoint.open(tiny_v41).config
    make_plan(cfg, {t.key: (16.0 if t.key == FP16_KEYS[0] else None) for t in targets(cfg)}).save(other)
    capsys.readouterr()
    assert _build(tiny_v41, other, out, "--seed", "1") == 2  # another plan would share the cache; another seed may not
    one_line(capsys.readouterr().err, "cannot resume a different quantize job: seed differs: 0 -> 1")
    assert _snapshot(work) == kept and not out.exists()


def test_an_existing_directory_of_the_users_is_not_a_work_directory(tiny_v41, plan_file, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert _build(tiny_v41, plan_file, tmp_path / "pack", "--work", str(mine)) == 2
    one_line(capsys.readouterr().err, "not a quantizer work directory")
    assert _snapshot(mine) == {"notes.txt": b"mine"} and not (tmp_path / "pack").exists()


def test_the_users_own_partial_directory_is_left_alone(tiny_v41, plan_file, tmp_path):
    theirs = tmp_path / "pack.partial"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("keep")
    assert _build(tiny_v41, plan_file, tmp_path / "pack") == 0
    assert _snapshot(theirs) == {"keep.txt": b"keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack", "pack.partial", "pack.work"]
    assert (tmp_path / "pack.work" / WORK_MARKER).exists()


# ---- 4. the checkpoint is checked against its config before any stage --------------------------

def _config(src: Path, edit) -> None:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg["text_config"])
    (src / "config.json").write_text(json.dumps(cfg))


def _scale_transposed(src: Path) -> None:
    name = "layers.0.attn.wkv.scale"
    shard = Checkpoint.open(src).entry(name).path
    _edit_header(shard, lambda h: h[name].__setitem__("shape", h[name]["shape"][::-1]))


@pytest.mark.parametrize("damage,message", [
    (lambda src: _config(src, lambda t: t.__setitem__("hidden_size", 512)), "does not match its config.json"),
    (_scale_transposed, "layers.0.attn.wkv.scale: stored as F8_E8M0[8, 4], config implies F8_E8M0[4, 8]"),
])
def test_a_checkpoint_its_config_does_not_describe_is_refused_before_any_stage(src, plan_file, tmp_path, capsys,
                                                                             damage, message):
    damage(src)
    kept = _snapshot(src)
    assert main(["build", str(src), "--bpw", "2.5", "--method", "uniform", "--no-calibrate",
                 "--out", str(tmp_path / "pack")]) == 2
    one_line(capsys.readouterr().err, message)
    assert _snapshot(src) == kept and not (tmp_path / "pack").exists() and not (tmp_path / "pack.work").exists()


# ---- 5. header checks: one clear line ------------------------------------------------------------

def _first_two(h: dict) -> tuple[str, str]:
    same = [n for n in h if n != "__metadata__" and h[n]["dtype"] == "BF16" and h[n]["shape"] == [256]]
    return same[0], same[1]


def _alias(h: dict) -> None:
    a, b = _first_two(h)
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _overlap(h: dict) -> None:
    a, b = _first_two(h)
    h[b]["data_offsets"] = [h[a]["data_offsets"][0] + 2, h[a]["data_offsets"][1] + 2]


def _index(src: Path, edit) -> None:
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("damage,message", [
    (lambda s: _edit_header(s / "model-00001-of-00004.safetensors", _alias), "share bytes (overlapping data_offsets)"),
    (lambda s: _edit_header(s / "model-00001-of-00004.safetensors", _overlap), "share bytes (overlapping data_offsets)"),
    (lambda s: _edit_header(s / "model-00001-of-00004.safetensors",
                            lambda h: h[_first_two(h)[0]].__setitem__("data_offsets", [0])), "not [begin, end] byte offsets"),
    (lambda s: _edit_header(s / "model-00001-of-00004.safetensors",
                            lambda h: h[_first_two(h)[0]].__setitem__("data_offsets", "0-512")), "not [begin, end] byte offsets"),
    (lambda s: _index(s, lambda m: m.__setitem__(EXPERT, None)), f"weight_map puts {EXPERT} in None"),
    (lambda s: _config(s, lambda t: t.__setitem__("hidden_size", "256")), "hidden_size is '256'; it must be a whole number"),
    (lambda s: _config(s, lambda t: t.__setitem__("rms_norm_eps", "1e-6")), "rms_norm_eps is '1e-6'; it must be a number"),
    (lambda s: _config(s, lambda t: t.__setitem__("kv_source_layer_ids", "0,2")), "kv_source_layer_ids is '0,2'"),
])
def test_malformed_headers_index_and_config_are_one_line(src, tmp_path, capsys, damage, message):
    damage(src)
    kept = _snapshot(src)
    assert main(["inspect", str(src)]) == 2
    one_line(capsys.readouterr().err, message)
    assert main(["build", str(src), "--bpw", "2.5", "--method", "uniform", "--no-calibrate",
                 "--out", str(tmp_path / "pack")]) == 2
    one_line(capsys.readouterr().err, message)
    assert _snapshot(src) == kept and not (tmp_path / "pack").exists() and not (tmp_path / "pack.work").exists()


# ---- 6. disk and permissions ---------------------------------------------------------------------

def test_too_little_free_space_is_refused_before_any_stage_in_readable_sizes(tiny_v41, plan_file, tmp_path, capsys,
                                                                            monkeypatch):
    import quantizer.workdir as workdir

    free = 3 << 20
    real = workdir.shutil.disk_usage
    monkeypatch.setattr(workdir.shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    assert _build(tiny_v41, plan_file, tmp_path / "pack") == 2
    err = capsys.readouterr().err
    assert "the pack and the work directory needs ~" in err and "MiB but only 3.0 MiB are free" in err, err
    assert "0.00 GiB" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sizes_read_at_a_glance():
    assert [size_text(n) for n in (512, 3 << 10, 5 << 20, 196 << 30)] == ["512 B", "3.0 KiB", "5.0 MiB", "196.00 GiB"]


def test_a_full_disk_while_packing_is_one_line_and_leaves_no_half_pack(tiny_v41, plan_file, tmp_path, capsys,
                                                                     monkeypatch):
    from quantizer.pack import shards

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))

    monkeypatch.setattr(shards, "write_shard", full)
    assert _build(tiny_v41, plan_file, tmp_path / "pack") == 2
    one_line(capsys.readouterr().err, "no space left on the device; free some space and rerun the same command")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.work"]  # kept: the rerun resumes from it


def test_a_read_only_location_is_one_line(tiny_v41, plan_file, tmp_path, capsys, monkeypatch):
    real = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name == "pack.work":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert _build(tiny_v41, plan_file, tmp_path / "pack") == 2
    one_line(capsys.readouterr().err, "pack.work: the file system is read-only; choose a writable location")
    assert list(tmp_path.iterdir()) == []


# ---- 7 and 8. impossible requests are refused before anything is written ------------------------

@pytest.mark.parametrize("extra,message", [
    (["--bpw", "nan"], "--bpw nan: must be a number above 0 and at most 8"),
    (["--bpw", "inf"], "--bpw inf: must be a number above 0 and at most 8"),
    (["--bpw", "9"], "--bpw 9: must be a number above 0 and at most 8"),
    (["--bpw", "2.5", "--work", "{out}"], "must be separate directories"),
    (["--bpw", "2.5", "--work", "{out}/work"], "must be separate directories"),
])
def test_impossible_requests_exit_2_and_write_nothing(tiny_v41, tmp_path, capsys, extra, message):
    out = tmp_path / "pack"
    extra = [a.replace("{out}", str(out)) for a in extra]
    assert main(["build", str(tiny_v41), "--out", str(out), "--method", "uniform", "--no-calibrate", *extra]) == 2
    one_line(capsys.readouterr().err, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags", [
    ["--loader", "tensorfold", "--head-bits", "2.5"],  # the engine reads an integer head K
    ["--loader", "tensorfold", "--head-bits", "native"],  # the engine reads the head as EXL3 only
    ["--loader", "exllamav3-v41", "--drafter-bits", "3"],  # the drafter stays in source form without --overlay
])  # a K that is no EXL3 rate (9, 17, nan) is refused where the flag is read: tests/test_bad_input.py
def test_head_and_drafter_bits_a_profile_refuses_are_refused_by_build_in_plans_words(tiny_v41, tmp_path, capsys,
                                                                                      flags):
    assert main(["plan", str(tiny_v41), "--bpw", "3", *flags]) == 2
    planned = one_line(capsys.readouterr().err).split(": error: ", 1)[1]
    out = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--bpw", "3", "--method", "uniform", "--no-calibrate", "--out", str(out),
                 *flags]) == 2
    assert one_line(capsys.readouterr().err).split(": error: ", 1)[1] == planned
    assert list(tmp_path.iterdir()) == []


def test_build_plans_with_head_and_drafter_bits_as_plan_does(tiny_v41, plan_file, tmp_path, monkeypatch, capsys):
    """Stopped (Ctrl-C) at its first encoding, the build has kept the plan it made: plan's plan for the flags."""
    flags = ["--bpw", "3", "--loader", "tensorfold", "--head-bits", "4", "--drafter-bits", "3"]
    assert main(["plan", str(tiny_v41), *flags, "--out", str(tmp_path / "plan.json")]) == 0
    planned = Plan.load(tmp_path / "plan.json")
    monkeypatch.setattr(ResultStore, "save", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["build", str(tiny_v41), *flags, "--method", "uniform", "--no-calibrate",
                 "--out", str(tmp_path / "pack")]) == 130
    built = Plan.load(plan_files(tmp_path / "pack.work", tmp_path / "pack")[0])
    drafter = {built.k[t.key] for t in targets(Checkpoint.open(tiny_v41).config) if t.group == DRAFT}
    assert built.k["head"] == 4.0 and drafter == {3.0} and built.k == planned.k
    capsys.readouterr()
    assert _build(tiny_v41, plan_file, tmp_path / "other", "--head-bits", "4") == 2
    one_line(capsys.readouterr().err, f"--head-bits and --drafter-bits make a plan; {plan_file} is one already")


# ---- 9. ppl compares a pack only with its own source; NaN is an error ---------------------------

@pytest.fixture(scope="module")
def pack(tiny_v41, plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppl") / "pack"
    assert _build(tiny_v41, plan_file, out) == 0
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.npy"
    np.save(path, np.random.default_rng(1).integers(3, 4096, size=(1, 16)))
    return path


def test_the_manifest_records_the_content_fingerprint(tiny_v41, pack):
    assert Manifest.load(pack).source["fingerprint"] == source_fingerprint(Checkpoint.open(tiny_v41))


def test_ppl_against_a_checkpoint_the_pack_was_not_built_from_is_refused(pack, tiny_v4, rows, tmp_path, capsys):
    other = make_tiny(tmp_path / "other", "v41", seed=1)
    for src, message in ((tiny_v4, "a v4 checkpoint, but"), (other, "not the checkpoint")):
        assert main(["ppl", str(pack), "--against", str(src), "--tokens", str(rows)]) == 2
        one_line(capsys.readouterr().err, message)


def test_ppl_on_a_corrupt_pack_exits_2_naming_the_shard(pack, tmp_path, rows, capsys):
    corrupt = shutil.copytree(pack, tmp_path / "corrupt")
    ck = Checkpoint.open(corrupt)
    e = ck.entry("layers.0.attn_norm.weight")  # bf16: 0xFFFF is NaN, and the shard keeps its size
    with open(e.path, "r+b") as f:
        f.seek(e.offset)
        f.write(b"\xff\xff" * (e.nbytes // 2))
    assert main(["ppl", str(corrupt), "--tokens", str(rows)]) == 2
    one_line(capsys.readouterr().err, f"{e.path.name}: sha256")  # refused before measuring
    manifest = json.loads((corrupt / "manifest.json").read_text())  # a pack whose manifest vouches for the NaN
    for shard in manifest["shards"]:
        shard["sha256"] = fingerprint_module.sha256_file(corrupt / shard["file"])
    (corrupt / "manifest.json").write_text(json.dumps(Manifest.from_dict(manifest, "vouching").to_dict()))
    assert main(["ppl", str(corrupt), "--tokens", str(rows)]) == 2
    one_line(capsys.readouterr().err, "logits are not finite")


# ---- 10. a mistyped path fails at once, without trying the hub -----------------------------------

def test_a_mistyped_path_is_never_tried_as_a_repo_id(tmp_path, capsys, monkeypatch):
    from quantizer.checkpoint import source

    monkeypatch.setattr(source, "_from_hub", lambda *a: pytest.fail("tried the hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    for typo, why in (("./nonexistent", "owner/name"), ("checkpoints/v41", "checkpoints/ is a directory here"),
                      ("some/dir.", "no part starting or ending"), ("a--b/c", "no '--'")):
        assert main(["inspect", typo]) == 2
        one_line(capsys.readouterr().err, why)


def test_an_unreachable_hub_fails_at_once(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # huggingface_hub's own refusal
    assert main(["inspect", "someone/some-model"]) == 2
    one_line(capsys.readouterr().err, "not in the local Hugging Face cache and the hub cannot be reached")


# ---- 11. the quantize stage's needs on CUDA are checked before calibration, not after it -------------

def test_a_cuda_build_without_exllamav3_is_refused_before_calibration(tiny_v41, tmp_path, capsys, monkeypatch):
    """A GPU is visible but exllamav3 (which encodes on CUDA) is not installed: before, calibration ran
    (an hour on the real model) and the quantize stage refused after it."""
    import importlib
    import importlib.util

    import torch

    build_module = importlib.import_module("quantizer.orchestrate.stages")  # the package exports the function `build`
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "exllamav3" else real(name, *a))
    monkeypatch.setattr(build_module, "calibrate", lambda *a, **k: pytest.fail("calibrated before refusing"))
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, 200, size=(4, 32)))
    assert main(["build", str(tiny_v41), "--bpw", "2.5", "--method", "uniform", "--tokens", str(ids), "--device",
                 "cuda", "--out", str(tmp_path / "pack")]) == 2
    one_line(capsys.readouterr().err, "--device cuda needs exllamav3 1.6.5: pip install 'quantizer[gpu]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy"]
