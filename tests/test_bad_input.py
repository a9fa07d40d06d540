"""What a hostile but realistic user gets (issue 21's bad-input battery), one case per test: one clear
line and exit 2, or the right result; nothing the user had is changed, and no pack appears under its
final name before every check that can refuse it has passed.

Builds use a plan that stores ten attention linears as fp16 (units the quantize stage makes from the
source bytes in well under a second) and leaves the rest native.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from one_line import one_line
from test_build_guards import _build  # tests/ is on sys.path (pytest prepend import mode)

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import build_parser, main
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.quantize import results as results_module
from quantizer.quantize.results import RESULTS_DIR

build_module = importlib.import_module("quantizer.orchestrate.stages")  # the package exports the function `build`
FP16_KEYS = [f"layers.{layer}.attn.{p}" for layer in (0, 1) for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
LATE = "layers.1.attn.wo_b.weight"  # read by the last unit of the plan


def _plan_dict(ck: Path, k: dict[str, float | None] | None = None) -> dict:
    cfg = Checkpoint.open(ck).config
    k = k or {t.key: (16.0 if t.key in FP16_KEYS else None) for t in targets(cfg)}
    return make_plan(cfg, k).to_dict()


@pytest.fixture(scope="module")
def plan_file(tiny_v41, tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(_plan_dict(tiny_v41)))
    return path


@pytest.fixture(scope="module")
def clean_pack(tiny_v41, plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "pack"
    assert _build(tiny_v41, plan_file, out) == 0
    return out





def _flip(ck_root: Path, name: str) -> None:
    """XOR one byte in the middle of tensor `name` (the same call puts it back)."""
    e = Checkpoint.open(ck_root).entry(name)
    with open(e.path, "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        b = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))


def _shards(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.glob("*.safetensors"))}


def _units(work: Path) -> set[str]:
    return {p.name for p in (work / "quantize" / RESULTS_DIR).glob("*.safetensors")}


# ---- 1. a source byte changed while the build runs -------------------------------------------------

def test_a_source_byte_changed_during_quantize_is_refused_before_a_unit_of_it_is_saved(src, plan_file, clean_pack,
                                                                              tmp_path, capsys, monkeypatch):
    out, work = tmp_path / "pack", tmp_path / "pack.work"
    real = results_module.ResultStore.save
    saved = []

    def save(kill_after=None, flip_after=None):
        def hooked(self, unit, tensors, proxy_err):
            real(self, unit, tensors, proxy_err)
            saved.append(unit.name)
            if len(saved) == kill_after:
                raise KeyboardInterrupt  # the first run is killed with 3 units in the cache
            if len(saved) == flip_after:
                _flip(src, LATE)  # the second run: the source changes after 2 more units
        return hooked

    monkeypatch.setattr(results_module.ResultStore, "save", save(kill_after=3))
    assert _build(src, plan_file, out) == 130
    before = _units(work)
    assert len(before) == 3
    saved.clear()
    monkeypatch.setattr(results_module.ResultStore, "save", save(flip_after=2))
    capsys.readouterr()
    assert _build(src, plan_file, out) == 2
    shard = Checkpoint.open(src).entry(LATE).path.name
    one_line(capsys.readouterr().err, f"{shard} changed while this build read it", "the unit read from it was not saved")
    assert 2 <= len(saved) < 7 and len(_units(work)) == 3 + len(saved) and not out.exists()
    assert not list(tmp_path.glob("pack.partial*"))

    _flip(src, LATE)  # put back: the units kept were all read before the change, so the pack is the clean one
    monkeypatch.setattr(results_module.ResultStore, "save", real)
    assert _build(src, plan_file, out) == 0
    assert _shards(out) == _shards(clean_pack)


def test_a_source_byte_changed_between_quantize_and_pack_publishes_nothing(src, plan_file, tmp_path, capsys,
                                                                          monkeypatch):
    out, work = tmp_path / "pack", tmp_path / "pack.work"
    real = build_module.quantize

    def quantize_then_change(*args, **kwargs):
        result = real(*args, **kwargs)
        _flip(src, "layers.0.attn_norm.weight")  # a passed-through tensor
        return result

    monkeypatch.setattr(build_module, "quantize", quantize_then_change)
    assert _build(src, plan_file, out) == 2
    one_line(capsys.readouterr().err, "changed while this build read it (quantize)", "deleted the 10 unit(s)")
    assert _units(work) == set() and not (work / "quantize" / "job.json").exists() and not out.exists()


def test_a_source_byte_changed_while_packing_publishes_nothing(src, plan_file, tmp_path, capsys, monkeypatch):
    from quantizer.pack import writer

    out = tmp_path / "pack"
    real = writer._copy_side_files

    def copy_then_change(source, pack):
        copied = real(source, pack)
        _flip(src, "layers.0.attn_norm.weight")
        return copied

    monkeypatch.setattr(writer, "_copy_side_files", copy_then_change)
    assert _build(src, plan_file, out) == 2
    one_line(capsys.readouterr().err, "changed while this build packed it; the pack was not published")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.work", "src"]


# ---- 3-6. a hand-edited --plan is checked before any stage ----------------------------------------

def _edited(tiny_v41: Path, tmp_path: Path, edit) -> Path:
    """The plan with `edit(plan dict)` applied and its content_hash removed (as the tool says to)."""
    data = _plan_dict(tiny_v41)
    edit(data)
    data.pop("content_hash")
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _expert_k(data: dict) -> None:
    data["k"]["layers.0.ffn.experts.0.w2"] = 3.0  # one expert at K 3, its siblings native


@pytest.mark.parametrize("edit,needles", [
    (lambda d: d["k"].__setitem__("layers.0.attn.wq_a", 2.5),
     ["layers.0.attn.wq_a: K 2.5 is a half rate, but DSV4 attention takes integer K only"]),
    (_expert_k, ["breaks the exllamav3 loader profile", "layers.0.ffn.experts", "one_k_per_projection"]),
    (lambda d: d["k"].pop("layers.0.attn.wkv"), ["plan has no K for 1 target(s), e.g. layers.0.attn.wkv"]),
    (lambda d: d["k"].__setitem__("layers.0.attn.wkv", 17), ["layers.0.attn.wkv: K 17 is not an EXL3 rate"]),
    (lambda d: d["k"].__setitem__("layers.7.attn.wq_z", 4), ["no EXL3 target for, e.g. layers.7.attn.wq_z"]),
    (lambda d: d.__setitem__("arch", "v4"), ["plan is for arch v4, the model is v41"]),
])
def test_a_hand_edited_plan_is_refused_before_any_stage_naming_tensor_and_file(tiny_v41, tmp_path, capsys,
                                                                             monkeypatch, edit, needles):
    plan = _edited(tiny_v41, tmp_path, edit)
    monkeypatch.setattr(build_module, "quantize", lambda *a, **k: pytest.fail("a stage ran"))
    assert _build(tiny_v41, plan, tmp_path / "pack") == 2
    one_line(capsys.readouterr().err, str(plan), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.json"]  # no pack, no work directory


# ---- 7. ppl measures only a pack whose shards match its manifest ----------------------------------

@pytest.fixture(scope="module")
def exl3_pack(tiny_v41, tmp_path_factory):
    """A pack with one EXL3 linear (a trellis to flip a byte in)."""
    folder = tmp_path_factory.mktemp("exl3")
    plan = folder / "plan.json"
    k = {t.key: (16.0 if t.key in FP16_KEYS else None) for t in targets(Checkpoint.open(tiny_v41).config)}
    plan.write_text(json.dumps(_plan_dict(tiny_v41, {**k, "layers.0.attn.wq_b": 4.0})))
    assert _build(tiny_v41, plan, folder / "pack") == 0
    return folder / "pack"


def test_ppl_on_a_pack_with_one_flipped_trellis_byte_is_refused_naming_the_shard(exl3_pack, tmp_path, capsys):
    rows = tmp_path / "rows.npy"
    np.save(rows, np.random.default_rng(1).integers(3, 4096, size=(1, 16)))
    assert main(["ppl", str(exl3_pack), "--tokens", str(rows), "--json"]) == 0
    intact = json.loads(capsys.readouterr().out)["ppl"]
    corrupt = shutil.copytree(exl3_pack, tmp_path / "corrupt")
    _flip(corrupt, "layers.0.attn.wq_b.trellis")
    assert main(["ppl", str(corrupt), "--tokens", str(rows)]) == 2
    shard = Checkpoint.open(corrupt).entry("layers.0.attn.wq_b.trellis").path
    one_line(capsys.readouterr().err, f"{shard}: sha256", "run `quantizer verify --full")
    assert np.isfinite(intact)


# ---- 8. counts below 1 are refused while the arguments are read ------------------------------------

@pytest.mark.parametrize("argv", [
    ["plan", "--model-config", "x", "--bpw", "3", "--context", "0"],
    ["fit", "--model-config", "x", "--context", "0"],
    ["build", "src", "--sparks", "2", "--out", "o", "--context", "0"],
    ["build", "src", "--sparks", "2", "--out", "o", "--context", "-5"],
    ["plan", "--model-config", "x", "--bpw", "3", "--streams", "0"],
    ["fit", "--model-config", "x", "--streams", "-1"],
    ["build", "src", "--sparks", "2", "--out", "o", "--streams", "0"],
    ["build", "src", "--bpw", "3", "--out", "o", "--calib-rows", "0"],
])
def test_a_context_or_count_below_one_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    one_line(capsys.readouterr().err, "at least 1")


@pytest.mark.parametrize("argv,needle", [
    (["fit", "--model-config", "x", "--margin", "inf"], "GiB as a number >= 0"),
    (["fit", "--model-config", "x", "--margin", "nan"], "GiB as a number >= 0"),
    (["plan", "--model-config", "x", "--bpw", "3", "--head-bits", "nan"], "a K of 1..8"),
    (["build", "src", "--bpw", "3", "--out", "o", "--head-bits", "17"], "a K of 1..8"),
    (["fit", "--model-config", "x", "--drafter-bits", "4.2"], "a K of 1..8"),
])
def test_a_margin_or_k_that_is_no_number_of_its_kind_is_refused(argv, needle, capsys):
    """--margin inf once printed "inf GiB"; --head-bits nan or 17 was taken and never checked (issue 60)."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    one_line(capsys.readouterr().err, needle)


@pytest.mark.parametrize("flags,needle", [
    (["--head-bits", "5"], "--head-bits 5: the vllm-exl3 engine keeps the head in source form, so it would change nothing"),
    (["--drafter-bits", "4"], "--drafter-bits 4: the vllm-exl3 engine keeps the drafter in source form"),
    (["--loader", "exllamav3-v41", "--overlay", "attention", "--head-bits", "8"],
     "--head-bits 8: the exllamav3-v41 engine keeps the head in source form"),
])
def test_head_or_drafter_bits_an_engine_would_not_apply_are_refused(flags, needle, tmp_path, capsys):
    """On the V4.1 default profile --head-bits and --drafter-bits were taken and changed nothing (issue 60)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.5", *flags, "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, needle)
    assert not out.exists()


def test_head_bits_an_engine_applies_are_taken(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model-config", "tiny-v41", "--bpw", "2.5", "--loader", "tensorfold", "--head-bits", "5",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["head_bits"] == 5


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model-config", "tiny-v41", "--bpw", "2.5", "--out", "{file}/plan.json"], "is a file, not a directory"),
    (["plan", "--model-config", "tiny-v41", "--bpw", "2.5", "--recipe-out", "{dir}"], "a directory; give the file's path"),
    (["build", "src", "--bpw", "2.5", "--out", "{file}/pack"], "is a file, not a directory"),
    (["build", "src", "--bpw", "2.5", "--out", "{file}"], "a file; give a directory"),
    (["calibrate", "src", "--work", "{file}/work"], "is a file, not a directory"),
    (["make-tiny", "{file}"], "a file; give a directory"),
    (["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", "{binary}", "--sparks", "2"], "not a text file"),
    (["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", "{dir}", "--sparks", "2"], "a directory; give the file's path"),
    (["fit", "--model-config", "deepseek-v4.1-flash", "--plan", "{dir}", "--sparks", "2"], "a directory; give the file's path"),
    (["build", "src", "--plan", "{binary}", "--out", "{dir}/pack"], "not a text file"),
])
def test_a_path_of_the_wrong_kind_is_one_line_and_exit_2(argv, needle, tmp_path, capsys):
    """A file where a directory must be (or a directory, or a binary file, where a text file must be) once
    ended in a traceback (issue 60). Nothing is written, and the file in the way is unchanged."""
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "blob.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "folder").mkdir()
    paths = {"{file}": tmp_path / "notes.txt", "{dir}": tmp_path / "folder", "{binary}": tmp_path / "blob.yaml"}
    for key, path in paths.items():
        argv = [a.replace(key, str(path)) for a in argv]
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(argv))
    assert stop.value.code == 2
    one_line(capsys.readouterr().err, needle)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["blob.yaml", "folder", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


# ---- 2. torchrun ranks that read different bytes are refused -------------------------------------

TORCHRUN = Path(sys.executable).with_name("torchrun")
RANK1_READS = """
import os, sys
from quantizer.cli import main
args = sys.argv[2:]
if os.environ["RANK"] == "1":
    args[1] = sys.argv[1]  # rank 1 reads another copy of the checkpoint
sys.exit(main(args))
"""


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
def test_ranks_reading_copies_that_differ_in_one_byte_are_refused(src, plan_file, tiny_v41, tmp_path):
    """Two real gloo ranks on the CPU (torchrun): the copies share the layout, so only the content
    fingerprint every rank takes tells them apart; refused before any stage writes a unit."""
    _flip(src, LATE)
    launcher = tmp_path / "launch.py"
    launcher.write_text(RANK1_READS)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(30500 + os.getpid() % 1000), str(launcher),
           str(src), "build", str(tiny_v41), "--plan", str(plan_file), "--no-calibrate", "--out", str(tmp_path / "pack")]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert len(errors) == 2 and all(f"rank 1 (host {socket.gethostname()}) reads {src}, whose bytes differ" in line
                                    for line in errors), proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("  File ") and "quantizer" in line]
    assert not (tmp_path / "pack").exists() and _units(tmp_path / "pack.work") == set()
    assert not (tmp_path / "pack.work" / "quantize" / "job.json").exists()


def test_a_rank_on_rank_0s_host_borrows_its_shard_hashes(tiny_v41, tmp_path, monkeypatch):
    from quantizer.checkpoint import fingerprint

    ck = Checkpoint.open(tiny_v41)
    monkeypatch.setattr(fingerprint, "_HASHED", {})
    main_cache = tmp_path / "source.json"
    first = fingerprint.source_fingerprint(ck, main_cache)
    hashed = []
    monkeypatch.setattr(fingerprint, "_HASHED", {})  # another process
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p, progress=None: hashed.append(p))
    assert fingerprint.source_fingerprint(ck, tmp_path / "source.rank1.json", main_cache) == first and hashed == []


# ---- notes from the same run ------------------------------------------------------------------------

def test_a_build_killed_during_its_final_verify_leaves_no_pack_and_the_rerun_finishes(tiny_v41, plan_file,
                                                                                   clean_pack, tmp_path,
                                                                                   monkeypatch):
    out = tmp_path / "pack"
    real = build_module.verify_pack
    monkeypatch.setattr(build_module, "verify_pack", lambda pack: (_ for _ in ()).throw(KeyboardInterrupt))
    assert _build(tiny_v41, plan_file, out) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.work"]  # nothing under the final name
    monkeypatch.setattr(build_module, "verify_pack", real)
    assert _build(tiny_v41, plan_file, out) == 0
    assert _shards(out) == _shards(clean_pack)


def test_a_build_whose_pack_fails_verify_does_not_publish_it(tiny_v41, plan_file, tmp_path, capsys, monkeypatch):
    from quantizer.verify.checks import VerifyReport

    def one_fault(pack):
        report = VerifyReport(pack)
        report.fault("layers.0.attn.wq_a", "a fault verify found")
        return report

    monkeypatch.setattr(build_module, "verify_pack", one_fault)
    assert _build(tiny_v41, plan_file, tmp_path / "pack") == 2
    one_line(capsys.readouterr().err, "verify found 1 fault(s) in the new pack, so it was not published",
              "layers.0.attn.wq_a: a fault verify found")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.work"]


@pytest.mark.slow
def test_sigterm_is_one_line_and_keeps_finished_work(src, plan_file, clean_pack, tmp_path, capsys, monkeypatch):
    out, work = tmp_path / "pack", tmp_path / "pack.work"
    real = results_module.ResultStore.save
    saved = []

    def save_then_terminate(self, unit, tensors, proxy_err):
        real(self, unit, tensors, proxy_err)
        saved.append(unit.name)
        if len(saved) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stops the job
            time.sleep(5)  # the handler interrupts this

    monkeypatch.setattr(results_module.ResultStore, "save", save_then_terminate)
    assert _build(src, plan_file, out) == 143
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1] == "quantizer build: interrupted by SIGTERM; rerun the same command to resume"
    assert "Traceback" not in err and not out.exists()
    assert len(_units(work)) == len(saved) >= 3  # every unit written (the writer thread may finish one more) is kept
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only as long as the command
    monkeypatch.setattr(results_module.ResultStore, "save", real)
    assert _build(src, plan_file, out) == 0
    assert _shards(out) == _shards(clean_pack)


def test_inspect_refuses_an_index_that_points_a_tensor_at_the_wrong_shard(src, capsys):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    held = index["weight_map"][LATE]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != held)
    index["weight_map"][LATE] = other
    index_path.write_text(json.dumps(index))
    assert main(["inspect", str(src)]) == 1
    out = capsys.readouterr().out
    assert f"maps 1 tensor(s) to a shard that does not hold them, e.g. {LATE} to {other} (it is in {held})" in out
    assert "consistent with config.json" not in out


def test_inspect_on_a_pack_says_it_is_a_pack(clean_pack, capsys):
    assert main(["inspect", str(clean_pack)]) == 2
    one_line(capsys.readouterr().err, "this is an EXL3 pack written by quantizer", f"use `quantizer verify {clean_pack}`")


@pytest.mark.parametrize("edit", [
    lambda m: m["source"].__setitem__("fingerprint", "sha256:" + "0" * 64),
    lambda m: m["plan"].__setitem__("loader", "tensorfold" if m["plan"]["loader"] != "tensorfold" else "exllamav3"),
    lambda m: m.pop("claims_sha256"),
])
def test_verify_finds_an_edit_of_the_manifests_claims(clean_pack, tmp_path, capsys, edit):
    pack = shutil.copytree(clean_pack, tmp_path / "pack")
    manifest = json.loads((pack / "manifest.json").read_text())
    edit(manifest)
    (pack / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(pack)]) == 1
    assert "FAULT manifest.json: " in capsys.readouterr().out
