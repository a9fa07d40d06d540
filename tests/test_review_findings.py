"""The code review's findings (issue 21), one test each where a test can show it: dependencies pinned
where CI installs them, safetensors as the cross-check of our reader and writer, zstandard optional,
locks on regular files with one line for a filesystem that cannot lock, rank 0's failures reaching
the other ranks, nothing written into --work before the claim, the fingerprint cache across hard
links, --measured-errors read after the claim, one source for the calibration defaults, no stale fit
verdict in the manifest, one Engram-table predicate, and Hugging Face refusals as one line each."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors_check import assert_safetensors_agree

from quantizer import distributed, workdir
from quantizer.build.preflight import claim
from quantizer.checkpoint import fingerprint
from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors
from quantizer.checkpoint.source import Checkpoint, is_engram_table
from quantizer.cli import build_parser, main
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.fit import fit_table, pack_fit_table, stored_from_pack
from quantizer.model.layout import native_layout
from quantizer.model.targets import targets
from quantizer.model.tensor_classes import ENGRAM_TABLE, classify
from quantizer.pack.manifest import MANIFEST_NAME, Manifest
from quantizer.quantize.results import RESULTS_DIR, SUFFIX
from quantizer.textdata import read_texts

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _one_line(err: str, needle: str) -> None:
    """The run ended on one error line holding `needle`, without a traceback."""
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and needle in errors[0] and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def fp16_plan(tiny_v41, tmp_path_factory):
    """A plan that encodes nothing (two linears kept as fp16, the rest native): a pack in seconds."""
    cfg = Checkpoint.open(tiny_v41).config
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(cfg, {t.key: (16.0 if t.key.endswith("layers.0.attn.wq_a") else None) for t in targets(cfg)}).save(path)
    return path


# ---- dependencies: ranges in pyproject, exact pins in constraints.txt, which make and CI use ----------

def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_declares_ranges_and_constraints_pin_every_dependency_torch_to_the_cpu_build():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    assert pins["torch"] == "2.13.0"  # the local CPU wheel; a newer torch would be a multi-GB CUDA build
    assert not [r for r in project["dependencies"] if "==" in r], "runtime dependencies are ranges"
    wanted = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    missing = {_requirement_name(r) for r in wanted if not r.startswith("quantizer")} - set(pins)
    assert not missing, f"constraints.txt pins no version of {sorted(missing)}"
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -c constraints.txt -e '.[dev]'" in makefile
    test_target = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert test_target.index("ruff check .") < test_target.index("pytest")


def test_safetensors_is_the_dev_extras_cross_check_and_zstandard_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    assert "safetensors" not in runtime and "zstandard" not in runtime  # the package imports neither
    assert any(_requirement_name(r) == "safetensors" for r in project["optional-dependencies"]["dev"])
    assert [_requirement_name(r) for r in project["optional-dependencies"]["zstd"]] == ["zstandard"]
    assert not [p for p in (ROOT / "quantizer").rglob("*.py") if re.search(r"^\s*(import|from) safetensors\b",
                                                                         p.read_text(), re.M)]


# ---- safetensors: our writer's files read by it, its files read by us, both ways byte for byte ---------

def test_our_writer_and_reader_agree_with_the_safetensors_package_on_every_dtype_we_use(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 32, generator=g)
    tensors = [
        planned("fp8", values.to(torch.float8_e4m3fn)),
        planned("e8m0", torch.randint(0, 255, (4, 1), dtype=torch.uint8, generator=g), "F8_E8M0"),
        planned("fp4", torch.randint(-128, 127, (4, 16), dtype=torch.int8, generator=g)),
        planned("bf16", values.bfloat16()), planned("f32", values), planned("i16", (values * 100).short()),
        planned("empty", torch.empty(0, 8, dtype=torch.float16)), planned("scalar", torch.tensor(3.5)),
    ]
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata={"format": "pt"}, align=64)
    assert assert_safetensors_agree(ours) == 1
    loaded = load_file(ours)
    assert torch.equal(loaded["fp8"].view(torch.uint8), values.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(loaded["bf16"], values.bfloat16()) and loaded["scalar"].item() == 3.5

    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": values.bfloat16(), "s": values.to(torch.float8_e4m3fn)}, theirs, metadata={"k": "v"})
    assert assert_safetensors_agree(theirs) == 1
    header = read_header(theirs)
    assert header.metadata == {"k": "v"} and torch.equal(read_tensor(header.tensors["w"]), values.bfloat16())


def test_the_cross_check_fails_when_our_reader_is_wrong(tmp_path, monkeypatch):
    import safetensors_check

    path = tmp_path / "x.safetensors"
    write_safetensors(path, [planned("w", torch.arange(8, dtype=torch.float32))])
    real = safetensors_check.read_bytes
    monkeypatch.setattr(safetensors_check, "read_bytes", lambda e: bytes([real(e)[0] ^ 1]) + bytes(real(e)[1:]))
    with pytest.raises(AssertionError, match="w: bytes differ"):
        assert_safetensors_agree(path)


# ---- zstandard: optional, one line when it is missing --------------------------------------------------

def test_a_zst_input_without_zstandard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "text.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    with pytest.raises(UserError, match=r"text.jsonl.zst: reading .zst files needs the zstandard package: "
                                        r"pip install 'quantizer\[zstd\]'"):
        read_texts(path)


# ---- locks: regular files only; a filesystem that cannot lock is one line ------------------------------

@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EIO])
def test_a_filesystem_that_cannot_lock_is_one_line(tiny_v41, fp16_plan, tmp_path, monkeypatch, capsys, code):
    def refuse(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(workdir.fcntl, "flock", refuse)
    args = ["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(tmp_path / "pack"), "--no-calibrate"]
    assert main(args) == 2
    why = "this filesystem cannot lock files" if code != errno.EIO else "cannot lock (Input/output error)"
    _one_line(capsys.readouterr().err, f"{tmp_path / 'pack.work' / workdir.LOCK_NAME}: {why}")
    assert not (tmp_path / "pack").exists()


def test_every_lock_is_taken_on_a_regular_file_and_the_partial_directorys_lock_refuses_a_second_build(tmp_path,
                                                                                                     monkeypatch):
    out = tmp_path / "pack"
    stale = tmp_path / "pack.partial-0123456789ab"  # left by a build that was killed: no lock held
    stale.mkdir()
    locked = []
    real = fcntl.flock

    def only_files(fd, op):
        assert stat.S_ISREG(os.fstat(fd).st_mode), "flock on something other than a regular file"
        locked.append(op)
        return real(fd, op)

    monkeypatch.setattr(workdir.fcntl, "flock", only_files)
    with claim(out, tmp_path / "first.work") as partial:
        lock = partial.with_name(partial.name + ".lock")
        assert lock.is_file() and len(locked) == 2  # the work directory's, then the partial directory's
        with pytest.raises(UserError, match="another build is writing this pack"):
            with claim(out, tmp_path / "second.work"):
                pass
    assert not partial.exists() and not lock.exists() and stale.is_dir()


def test_the_claim_makes_the_packs_parent_directory_before_locking_beside_it(tmp_path):
    out = tmp_path / "packs" / "pack"  # the demo's layout: packs/ does not exist yet
    with claim(out, tmp_path / "pack.work") as partial:
        assert partial.is_dir() and partial.with_name(partial.name + ".lock").is_file()


# ---- torchrun: rank 0's own failure reaches the others as one line -------------------------------------

def test_rank_0s_failure_is_one_line_on_the_other_ranks(monkeypatch):
    told = []

    def share(self, obj):
        if self.main:
            told.append(obj)
        return told[0]

    monkeypatch.setattr(distributed.Ranks, "share", share)
    rank0 = distributed.Ranks(0, 2, 0, control=object())
    rank1 = distributed.Ranks(1, 2, 0, control=object())

    def full_disk():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/shared/pack.partial-1/model-00001.safetensors")

    with pytest.raises(OSError) as own:  # rank 0 keeps its own error (the CLI prints it as one line)
        rank0.on_main(full_disk)
    assert own.value.errno == errno.ENOSPC
    with pytest.raises(UserError) as other:
        rank1.on_main(lambda: pytest.fail("only rank 0 runs it"))
    assert str(other.value) == ("rank 0 stopped: /shared/pack.partial-1/model-00001.safetensors: No space left on "
                                "device; its own output says more")


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A joined torch.distributed context of one rank (gloo), so the multi-rank code paths run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(distributed, "_current", distributed.Ranks(0, 1, 0, dist.new_group(backend="gloo")))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_shared_directory_check_writes_nothing_into_a_work_directory_it_was_refused(
        tiny_v41, fp16_plan, tmp_path, one_rank_group, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = os.stat(mine).st_mtime_ns
    time.sleep(0.05)  # a file made and removed in mine now would move its mtime
    assert main(["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(tmp_path / "pack"), "--no-calibrate",
                 "--work", str(mine)]) == 2
    _one_line(capsys.readouterr().err, "not a quantizer work directory")
    assert os.stat(mine).st_mtime_ns == before and [p.name for p in mine.iterdir()] == ["notes.txt"]


# ---- the fingerprint cache: a hard link is not a change ------------------------------------------------

def test_a_hard_linked_shard_is_not_hashed_again_but_a_written_one_is(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    (root / "config.json").write_text("{}")
    shards = [root / f"model-{i}.safetensors" for i in range(2)]
    for i, s in enumerate(shards):
        s.write_bytes(bytes([i]) * 4096)
    calls = []
    real = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p, progress=None: calls.append(p) or real(p, progress))
    cache = tmp_path / "source.json"
    monkeypatch.setattr(fingerprint, "_HASHED", {})
    first = fingerprint.files_fingerprint(root, shards, cache)
    assert len(calls) == 2

    ctime = shards[0].stat().st_ctime_ns
    time.sleep(0.05)
    os.link(shards[0], tmp_path / "pack-shard.safetensors")  # what the pack does with an Engram shard
    assert shards[0].stat().st_ctime_ns != ctime  # the kernel moved ctime (docs/filesystem.md)
    monkeypatch.setattr(fingerprint, "_HASHED", {})  # a new process: only the cache remembers
    assert fingerprint.files_fingerprint(root, shards, cache) == first and len(calls) == 2

    with open(shards[1], "r+b") as f:
        f.write(b"\xff")
    monkeypatch.setattr(fingerprint, "_HASHED", {})
    assert fingerprint.files_fingerprint(root, shards, cache) != first and calls[2:] == [shards[1]]


# ---- --measured-errors reads the cache only once the work directory is claimed -------------------------

def test_measured_errors_never_read_a_directory_that_is_not_a_work_directory(tiny_v41, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "quantize" / RESULTS_DIR).mkdir(parents=True)
    (mine / "quantize" / RESULTS_DIR / f"unit{SUFFIX}").write_bytes(b"not a safetensors file of ours")
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, 4096, size=(2, 16)))
    assert main(["build", str(tiny_v41), "--bpw", "2.5", "--out", str(tmp_path / "pack"), "--work", str(mine),
                 "--measured-errors", "--tokens", str(tokens)]) == 2
    _one_line(capsys.readouterr().err, "not a quantizer work directory")


# ---- one source for the calibration defaults -----------------------------------------------------------

def test_build_and_calibrate_state_the_same_calibration_defaults():
    from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS

    assert (DEFAULT_ROWS, DEFAULT_COLS) == (250, 2048)  # exllamav3's calibration
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, rows, cols in (("build", "--calib-rows", "--calib-cols"), ("calibrate", "--rows", "--cols")):
        helps = {a.option_strings[0]: a.help for a in sub[command]._actions if a.option_strings}
        assert f"up to {DEFAULT_ROWS}," in helps[rows] and helps[cols].endswith(f"else {DEFAULT_COLS})")


# ---- the manifest keeps no fit verdict; the fit is computed against today's profile ------------------

def test_the_manifest_holds_no_fit_verdict_and_old_ones_are_ignored(tiny_v41, fp16_plan, tmp_path):
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(pack), "--no-calibrate"]) == 0
    assert_safetensors_agree(pack)
    data = json.loads((pack / MANIFEST_NAME).read_text())
    assert "fit" not in data
    cfg, stored = stored_from_pack(pack)
    assert pack_fit_table(pack) == fit_table(cfg, stored, context=cfg.max_position_embeddings)
    data["fit"] = {"topologies": {"1": {"vllm": {"fits": True}}}}  # what an older version wrote
    assert Manifest.from_dict(data, "old manifest").shards == Manifest.load(pack).shards


# ---- one answer to "is this an Engram table" -----------------------------------------------------------

def test_one_engram_table_predicate_answers_for_every_reader(tiny_v41, full_v41):
    cfg = Checkpoint.open(full_v41).config
    names = [spec.name for spec in native_layout(cfg)]
    tables = {n for n in names if is_engram_table(n)}
    assert tables == {n for n in names if re.fullmatch(r"layers\.\d+\.engram\.embed\.(weight|scale)", n)}
    assert len(tables) == 2 * len(cfg.engram_layer_ids) and tables == {n for n in names
                                                                        if classify(n).cls == ENGRAM_TABLE}
    full = Checkpoint.open(tiny_v41)
    without = Checkpoint.open(tiny_v41, include_engram=False)
    assert set(full.tensors) - set(without.tensors) == {n for n in full.tensors if is_engram_table(n)} != set()


# ---- Hugging Face: huggingface_hub decides, and each refusal is one line -------------------------------

def _hub_error(status: int, code: str | None = None):
    """The exception huggingface_hub itself raises for this response (its own status mapping)."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    url = "https://huggingface.co/someone/some-model/resolve/main/config.json"
    response = httpx2.Response(status, headers={"X-Error-Code": code} if code else {},
                               request=httpx2.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as e:  # noqa: BLE001 - the error under test
        return e
    raise AssertionError("no error for this response")


def _offline():
    from huggingface_hub.errors import LocalEntryNotFoundError

    return LocalEntryNotFoundError("cannot reach the hub and not cached")


@pytest.mark.parametrize("error, needle", [
    (_offline, "config.json is not in the local Hugging Face cache and the hub cannot be reached"),
    (lambda: _hub_error(403, "GatedRepo"), "someone/some-model: a gated repository this login has no access to; "
                                           "accept its terms at"),
    (lambda: _hub_error(401), "someone/some-model: no such repository on the hub, or a private one"),
    (lambda: _hub_error(404, "RepoNotFound"), "no such repository on the hub"),
    (lambda: _hub_error(404, "RevisionNotFound"), "no revision 'v2' on the hub; check --revision"),
    (lambda: _hub_error(403), "the hub refused config.json (HTTP 403); log in"),
    (lambda: _hub_error(500), "cannot fetch config.json (HTTP 500)"),
])
def test_each_hub_refusal_is_one_line(tmp_path, monkeypatch, capsys, error, needle):
    import huggingface_hub

    def download(repo_id, filename, revision=None, local_files_only=False):
        if local_files_only:
            raise _offline()
        raise error()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert main(["inspect", "someone/some-model", "--revision", "v2"]) == 2
    _one_line(capsys.readouterr().err, needle)


def test_a_repo_without_an_index_is_read_as_one_file_but_a_refused_index_is_not(tiny_v41, tmp_path, monkeypatch,
                                                                                   capsys):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    single = tmp_path / "snapshot"
    single.mkdir()
    shutil.copy(tiny_v41 / "config.json", single / "config.json")
    ck = Checkpoint.open(tiny_v41)
    write_safetensors(single / "model.safetensors", [planned(n, read_tensor(e), e.dtype) for n, e in ck.tensors.items()],
                      align=1)
    asked = []

    def download(repo_id, filename, revision=None, local_files_only=False, index_error=None):
        asked.append((filename, local_files_only))
        if local_files_only and filename != "config.json":
            raise LocalEntryNotFoundError("not cached")
        if filename == "model.safetensors.index.json":
            raise index_error()
        return str(single / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: download(*a, **k, index_error=lambda: _hub_error(404, "EntryNotFound")))
    assert main(["inspect", "someone/some-model"]) == 0
    assert ("model.safetensors", False) in asked
    capsys.readouterr()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: download(*a, **k, index_error=lambda: _hub_error(403, "GatedRepo")))
    assert main(["inspect", "someone/some-model"]) == 2
    _one_line(capsys.readouterr().err, "a gated repository")
