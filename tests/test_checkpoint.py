"""Checkpoint IO: opening every source kind lazily, and one clear error for every kind of bad input."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from one_line import one_line

from quantizer.checkpoint import safetensors_file
from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors
from quantizer.checkpoint.source import INDEX_NAME, Checkpoint, is_engram_table
from quantizer.cli import main
from quantizer.errors import UserError
from quantizer.model.layout import native_layout
from quantizer.model.tensor_classes import ENGRAM_TABLE, classify
from quantizer.report import size_text


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def shard_of(ck_dir: Path, tensor: str) -> Path:
    index = json.loads((ck_dir / INDEX_NAME).read_text())
    return ck_dir / index["weight_map"][tensor]


def test_open_reads_headers_only_until_a_tensor_is_asked_for(tiny_v41, monkeypatch):
    reads = []
    real = safetensors_file.read_bytes
    monkeypatch.setattr(safetensors_file, "read_bytes", lambda e: reads.append(e.name) or real(e))
    ck = Checkpoint.open(tiny_v41)
    assert len(ck.tensors) == 990 and reads == []
    w = ck.weight("layers.2.attn.wq_a.weight")
    assert w.shape == (128, 256) and w.dtype == torch.float32
    assert reads == ["layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale"]


def test_dequantized_fp4_expert_and_bf16_on_request(tiny_v41):
    ck = Checkpoint.open(tiny_v41)
    e = ck.weight("layers.0.ffn.experts.3.w2.weight", dtype=torch.bfloat16)
    assert e.shape == (256, 128) and e.dtype == torch.bfloat16 and e.abs().sum() > 0
    tid = ck.weight("layers.0.ffn.gate.bias")
    assert tid.dtype == torch.float32


def test_integer_tables_stay_integers(tiny_v4):
    ck = Checkpoint.open(tiny_v4)
    table = ck.weight("layers.0.ffn.gate.tid2eid")
    assert table.dtype == torch.int64 and table.shape == (4096, 2)
    assert (table[:, 0] != table[:, 1]).all() and table.max() < 8


def test_single_file_checkpoint(tiny_v4, tmp_path):
    ck = Checkpoint.open(tiny_v4)
    names = ["layers.1.attn.wkv.weight", "layers.1.attn.wkv.scale", "embed.weight"]
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(tiny_v4 / "config.json", single / "config.json")
    write_safetensors(single / "model.safetensors", [planned(n, ck.raw(n), ck.entry(n).dtype) for n in names], align=1)
    one = Checkpoint.open(single)
    assert set(one.tensors) == set(names)
    assert torch.equal(one.weight(names[0]), ck.weight(names[0]))


def test_leaving_engram_out_needs_no_table_shards(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    ck = Checkpoint.open(ck_dir, include_engram=False)
    assert not any(".engram.embed." in n for n in ck.tensors)
    assert "layers.1.engram.wkv.weight" in ck.tensors
    full = Checkpoint.open(ck_dir)
    assert "layers.1.engram.embed.weight" in full.tensors


def test_hub_repo_id_resolves_through_the_local_cache(tiny_v41, tmp_path, monkeypatch):
    """Offline: a cache laid out the way huggingface_hub stores snapshots."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--deepseek-ai--Tiny-V41"
    snap = repo / "snapshots" / commit
    shutil.copytree(tiny_v41, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    ck = Checkpoint.open("deepseek-ai/Tiny-V41", revision=commit)
    assert len(ck.tensors) == 990 and ck.root == snap
    assert Checkpoint.open("deepseek-ai/Tiny-V41").root == snap
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        Checkpoint.open("deepseek-ai/Other-Model")


# ---- bad input: one clear line naming the file or tensor ------------------------------------


def test_missing_shard(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    victim = shard_of(ck_dir, "embed.weight")
    victim.unlink()
    with pytest.raises(UserError, match=f"{victim.name}: shard is missing"):
        Checkpoint.open(ck_dir)


def test_truncated_shard(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    victim = shard_of(ck_dir, "embed.weight")
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(UserError, match=f"{victim.name}: truncated: tensor .* re-download"):
        Checkpoint.open(ck_dir)


def test_index_entry_that_no_shard_holds(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    index = json.loads((ck_dir / INDEX_NAME).read_text())
    index["weight_map"]["layers.0.attn.phantom.weight"] = index["weight_map"]["embed.weight"]
    (ck_dir / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(UserError, match="puts layers.0.attn.phantom.weight in .* does not hold it"):
        Checkpoint.open(ck_dir)


def _rewrite_header(path: Path, edit) -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        rest = f.read()
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + rest)


def test_scale_grid_that_does_not_tile_its_weight(tiny_v4, tmp_path):
    ck = Checkpoint.open(tiny_v4)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(tiny_v4 / "config.json", bad / "config.json")
    weight = ck.raw("layers.1.attn.wq_b.weight")  # [512, 128]: a 128x128 grid is [4, 1]
    grid = torch.full((3, 1), 127, dtype=torch.uint8)
    write_safetensors(
        bad / "model.safetensors",
        [planned("layers.1.attn.wq_b.weight", weight), planned("layers.1.attn.wq_b.scale", grid, "F8_E8M0")],
    )
    with pytest.raises(UserError, match=r"layers\.1\.attn\.wq_b\.scale: scale grid \[3, 1\] does not tile weight \[512, 128\]"):
        Checkpoint.open(bad)


def test_dtype_the_format_does_not_allow(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    shard = shard_of(ck_dir, "norm.weight")
    _rewrite_header(shard, lambda h: h["norm.weight"].update(dtype="Q4_K"))
    with pytest.raises(UserError, match="tensor norm.weight has dtype 'Q4_K', which safetensors does not define"):
        read_header(shard)


def test_unknown_architecture(tiny_v41, tmp_path):
    ck_dir = copy(tiny_v41, tmp_path)
    cfg = json.loads((ck_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (ck_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unknown architecture LlamaForCausalLM"):
        Checkpoint.open(ck_dir)


def test_not_a_checkpoint_and_not_a_repo_id(tmp_path):
    with pytest.raises(UserError, match="no such directory, and not a Hugging Face repo id"):
        Checkpoint.open(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        Checkpoint.open(tmp_path)


def test_cli_prints_one_line_and_exits_2(tiny_v41, tmp_path, capsys):
    ck_dir = copy(tiny_v41, tmp_path)
    shard_of(ck_dir, "embed.weight").unlink()
    assert main(["inspect", str(ck_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quantizer inspect: error: ") and "shard is missing" in err[0]


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


def _hub_error(status: int, code: str | None = None):
    """The exception huggingface_hub itself raises for this response (its own status mapping)."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    url = "https://huggingface.co/api/models/someone/some-model/revision/v2"
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


COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """huggingface_hub's snapshot_download over a folder standing for the repository at COMMIT: the files
    `allow_patterns` matches (huggingface_hub's own filter) are copied into a cache snapshot named by the
    commit; local_files_only answers from that snapshot as huggingface_hub does without a cached tree
    listing (the folder, complete or not); a dry run lists each file with its size and whether it would
    download. `refuse(call)` may return an exception to raise for a call."""

    def __init__(self, repo: Path, cache: Path, refuse=lambda call: None):
        self.repo, self.cache, self.refuse = repo, cache, refuse
        self.snapshot = cache / "models--someone--some-model" / "snapshots" / COMMIT
        self.calls = []

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, local_files_only=False, dry_run=False,
                 max_workers=8, **rest):
        from huggingface_hub.errors import LocalEntryNotFoundError
        from huggingface_hub.file_download import DryRunFileInfo
        from huggingface_hub.utils import filter_repo_objects

        call = {"revision": revision, "patterns": list(allow_patterns), "local": local_files_only, "dry": dry_run,
                "workers": max_workers}
        self.calls.append(call)
        error = self.refuse(call)
        if error:
            raise error
        if local_files_only:
            if not self.snapshot.is_dir():
                raise LocalEntryNotFoundError("no cached snapshot")
            return str(self.snapshot)
        files = sorted(filter_repo_objects([f.name for f in self.repo.iterdir()], allow_patterns=allow_patterns))
        if dry_run:
            return [DryRunFileInfo(COMMIT, (self.repo / f).stat().st_size, f, str(self.snapshot / f),
                                   (self.snapshot / f).exists(), not (self.snapshot / f).exists()) for f in files]
        self.snapshot.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(self.repo / f, self.snapshot / f)
        return str(self.snapshot)


@pytest.fixture
def fake_hub(tiny_v41, tmp_path, monkeypatch):
    """The tiny checkpoint as a hub repository (with a tokenizer, a licence and a README, which no run
    reads) behind a fake snapshot_download, its cache in tmp_path."""
    import huggingface_hub
    from huggingface_hub import constants

    repo = copy(tiny_v41, tmp_path)
    for name in ("tokenizer.json", "LICENSE", "README.md"):
        (repo / name).write_text("{}")
    hub = FakeHub(repo, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    return hub


def test_a_hub_source_is_two_snapshots_of_only_the_files_the_run_reads_and_then_cached(fake_hub, capsys):
    shards = sorted(set(json.loads((fake_hub.repo / INDEX_NAME).read_text())["weight_map"].values()))
    ck = Checkpoint.open("someone/some-model", revision="v2")
    assert ck.root == fake_hub.snapshot and len(ck.tensors) == 990
    metadata, weights = fake_hub.calls[1], fake_hub.calls[-1]
    assert [(c["revision"], c["local"], c["dry"]) for c in fake_hub.calls] == [
        ("v2", True, False), ("v2", False, False),  # config, index, side files: cache first, then the hub
        (COMMIT, True, False), (COMMIT, False, True), (COMMIT, False, False)]  # shards at the index's commit
    assert {"config.json", INDEX_NAME, "tokenizer.json", "LICENSE*"} <= set(metadata["patterns"])
    assert weights["patterns"] == shards and weights["workers"] > 1
    assert sorted(f.name for f in fake_hub.snapshot.iterdir()) == sorted(
        ["config.json", INDEX_NAME, "tokenizer.json", "LICENSE", *shards])  # no README
    need = sum((fake_hub.repo / f).stat().st_size for f in shards)
    said = capsys.readouterr().err
    assert (f"someone/some-model@v2: downloading {len(shards)} of {len(shards)} files, {size_text(need)}, into "
            f"{fake_hub.cache} (") in said
    fake_hub.calls.clear()
    assert Checkpoint.open("someone/some-model", revision="v2").tensors.keys() == ck.tensors.keys()
    assert [c["local"] for c in fake_hub.calls] == [True, True] and "downloading" not in capsys.readouterr().err


def test_a_hub_source_without_engram_fetches_no_shard_of_tables_alone(fake_hub):
    """As V4.1's index keeps its Engram tables in shards of their own."""
    ck = Checkpoint.open(fake_hub.repo)
    tables = {n: e for n, e in ck.tensors.items() if is_engram_table(n)}
    write_safetensors(fake_hub.repo / "tables.safetensors", [planned(n, read_tensor(e), e.dtype) for n, e in tables.items()])
    index = json.loads((fake_hub.repo / INDEX_NAME).read_text())
    index["weight_map"].update({n: "tables.safetensors" for n in tables})
    (fake_hub.repo / INDEX_NAME).write_text(json.dumps(index))
    without = Checkpoint.open("someone/some-model", include_engram=False)
    assert "tables.safetensors" not in fake_hub.calls[-1]["patterns"] and not tables.keys() & without.tensors.keys()
    assert set(Checkpoint.open("someone/some-model").tensors) == set(ck.tensors)
    assert "tables.safetensors" in fake_hub.calls[-1]["patterns"]


def test_a_download_the_cache_disk_cannot_hold_is_refused_in_one_line_before_any_shard(fake_hub, monkeypatch,
                                                                                          capsys):
    from quantizer import workdir

    need = sum(f.stat().st_size for f in fake_hub.repo.glob("*.safetensors"))
    monkeypatch.setattr(workdir, "free_bytes", lambda path: need - 1)
    assert main(["inspect", "someone/some-model"]) == 2
    err = capsys.readouterr().err
    one_line(err, f"{fake_hub.cache}: downloading someone/some-model@main (HF_HUB_CACHE) needs {size_text(need)} "
                  f"but only {size_text(need - 1)} are free")
    assert len(err.strip().splitlines()) == 1
    assert not list(fake_hub.snapshot.glob("*.safetensors"))


def test_a_shard_the_index_names_but_the_repository_lacks_is_one_line(fake_hub, capsys):
    victim = shard_of(fake_hub.repo, "embed.weight")
    victim.unlink()
    assert main(["inspect", "someone/some-model"]) == 2
    one_line(capsys.readouterr().err, f"someone/some-model@main: its {INDEX_NAME} names {victim.name}, which the "
                                      "repository does not hold")


def test_a_repo_without_an_index_is_read_as_one_file(fake_hub, capsys):
    ck = Checkpoint.open(fake_hub.repo)
    write_safetensors(fake_hub.repo / "model.safetensors",
                      [planned(n, read_tensor(e), e.dtype) for n, e in ck.tensors.items()], align=1)
    for shard in ck.shards:
        shard.unlink()
    (fake_hub.repo / INDEX_NAME).unlink()
    assert main(["inspect", "someone/some-model"]) == 0
    assert fake_hub.calls[-1]["patterns"] == ["model.safetensors"]
    (fake_hub.repo / "model.safetensors").unlink()
    shutil.rmtree(fake_hub.cache)
    assert main(["inspect", "someone/some-model"]) == 2
    one_line(capsys.readouterr().err, f"the repository has no {INDEX_NAME} and no model.safetensors")


@pytest.mark.parametrize("error, needle", [
    (_offline, "someone/some-model@v2: config.json: not in the local Hugging Face cache and the hub cannot be "
               "reached"),
    (lambda: _hub_error(403, "GatedRepo"), "someone/some-model: a gated repository this login has no access to; "
                                           "accept its terms at"),
    (lambda: _hub_error(401), "someone/some-model: no such repository on the hub, or a private one"),
    (lambda: _hub_error(404, "RepoNotFound"), "no such repository on the hub"),
    (lambda: _hub_error(404, "RevisionNotFound"), "no revision 'v2' on the hub; check --revision"),
    (lambda: _hub_error(403), "the hub refused config.json (HTTP 403); log in"),
    (lambda: _hub_error(500), "cannot fetch config.json (HTTP 500)"),
])
def test_each_hub_refusal_is_one_line(fake_hub, capsys, error, needle):
    fake_hub.refuse = lambda call: _offline() if call["local"] else error()
    assert main(["inspect", "someone/some-model", "--revision", "v2"]) == 2
    one_line(capsys.readouterr().err, needle)


@pytest.mark.parametrize("cause, needle", [
    (lambda: _hub_error(403, "GatedRepo"), "someone/some-model: a gated repository"),
    (lambda: __import__("huggingface_hub").errors.OfflineModeIsEnabled("offline"),
     "someone/some-model@main: model-00001-of-00004.safetensors and 3 more shards: not in the local Hugging Face "
     "cache and the hub cannot be reached"),
])
def test_a_refused_size_listing_is_one_line(fake_hub, capsys, cause, needle):
    """The shards' sizes come from a dry run, which wraps the hub's refusal in a DryRunError."""
    from huggingface_hub.errors import DryRunError

    def refuse(call):
        if call["dry"]:
            try:
                raise DryRunError("the repository cannot be accessed") from cause()
            except DryRunError as e:
                return e

    fake_hub.refuse = refuse
    assert main(["inspect", "someone/some-model"]) == 2
    one_line(capsys.readouterr().err, needle)


def test_tables_from_a_directory_without_its_index_or_a_shard_are_one_line(tiny_v41, tmp_path):
    """What `ppl` and `eval` meet when a tensorfold pack's Engram directory was copied only in part."""
    ck = Checkpoint.open(tiny_v41)
    sibling = tmp_path / "pack-Engram"
    sibling.mkdir()
    with pytest.raises(UserError, match=r"pack-Engram: no model.safetensors.index.json; .* Engram tables are kept there"):
        ck.with_tables_from(sibling)
    (sibling / INDEX_NAME).write_text(json.dumps({"weight_map": {"layers.1.engram.embed.weight": "gone.safetensors"}}))
    with pytest.raises(UserError, match=r"gone.safetensors: missing; .* names it"):
        ck.with_tables_from(sibling)
    write_safetensors(sibling / "gone.safetensors", [planned("something.else", torch.zeros(2))])
    with pytest.raises(UserError, match="which its shards do not hold"):
        ck.with_tables_from(sibling)
