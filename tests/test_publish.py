"""`quantizer publish`: only a pack that verifies is published, exactly the files its manifest names are
uploaded (card included) to the repository and branch asked for, --dry-run shows the files and the card.
A pack folder holding anything the pack does not own (a stray file or directory, a symbolic link, a
temporary file a full disk left) is refused naming it; ids and branch names the hub would refuse are
refused while the arguments are read; a missing token, offline mode, an unreachable hub and each refusal
of the hub are one line. The Hub is replaced by a recorder (and huggingface_hub's own errors): no network."""

from __future__ import annotations

import os
import shutil

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import hf_raise_for_status
from one_line import one_line

from quantizer.checkpoint.source import INDEX_NAME, Checkpoint
from quantizer.cli import build_parser, main
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.targets import targets
from quantizer.pack.card import CARD_NAME
from quantizer.pack.manifest import K_MAP_NAME, MANIFEST_NAME, Manifest
from quantizer.pack.owned import owned_files
from quantizer.publish.hub_upload import plan_publish, upload

REPO = "example-org/tiny-v41-exl3"


@pytest.fixture(scope="module")
def pack(tiny_v41, tmp_path_factory):
    """fp16 attention linears, the rest native: no encoding, so it builds in seconds."""
    root = tmp_path_factory.mktemp("publish")
    cfg = Checkpoint.open(tiny_v41).config
    make_plan(cfg, {t.key: (16.0 if t.key.startswith("layers.0.attn.") else None) for t in targets(cfg)}
              ).save(root / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--shard-size", "4M", "--no-calibrate"]) == 0
    return root / "pack"


class Hub:
    """Stands in for huggingface_hub.HfApi and records every call."""

    calls: list = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))


class OldHub(Hub):
    """huggingface_hub < 2, where the resumable upload is upload_large_folder."""

    def upload_large_folder(self, **kw):
        self.calls.append(("upload_large_folder", kw))


@pytest.fixture
def hub(monkeypatch):
    Hub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # whatever the environment says
    return Hub



def _state(pack) -> dict[str, object]:
    """Every entry of the folder: a link by its target, a directory by its listing, a file by its bytes."""
    return {p.name: (os.readlink(p) if p.is_symlink() else sorted(os.listdir(p)) if p.is_dir() else p.read_bytes())
            for p in sorted(pack.iterdir())}


def _listed(out: str) -> dict[str, int]:
    """file -> bytes from the table publish prints (up to the card)."""
    table = out.split("\n--- ")[0].splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("file ")) + 2
    return {name: int(size.replace(",", "")) for name, size in (line.split() for line in table[start:])}


def test_dry_run_lists_exactly_the_files_the_manifest_names_and_prints_the_card(pack, hub, capsys):
    assert main(["publish", str(pack), "--repo", REPO, "--dry-run"]) == 0
    out = capsys.readouterr().out
    manifest = Manifest.load(pack)
    assert _listed(out) == {name: (pack / name).stat().st_size for name in owned_files(manifest)}
    assert set(_listed(out)) == {p.name for p in pack.iterdir()} == {
        CARD_NAME, MANIFEST_NAME, "config.json", "quantization_config.json", K_MAP_NAME, INDEX_NAME,
        *(s.file for s in manifest.shards)}
    assert out.rstrip().endswith((pack / CARD_NAME).read_text().rstrip())
    assert hub.calls == []  # nothing touched the Hub


def _symlink_out(pack, name):
    """`name` in the pack as a link to a file outside it (as `ln -s /etc/passwd PACK/passwd.txt` makes)."""
    secret = pack.parent / "secret.txt"
    secret.write_text("a file of the machine, not of the pack\n")
    (pack / name).unlink(missing_ok=True)
    (pack / name).symlink_to(secret)


@pytest.mark.parametrize("make, name, what", [
    (lambda pack: (pack / "notes.txt").write_text("my notes"), "notes.txt", "a file the manifest does not name"),
    (lambda pack: (pack / "README.md.tmp").write_text("half a card"), "README.md.tmp",  # what a full disk left
     "a file the manifest does not name"),
    (lambda pack: _symlink_out(pack, "passwd.txt"), "passwd.txt", "a symbolic link"),
    (lambda pack: _symlink_out(pack, "config.json"), "config.json", "a symbolic link"),  # a name the pack owns
    (lambda pack: (pack / "extra").mkdir(), "extra", "a directory the manifest does not name"),
])
def test_a_pack_folder_holding_what_the_pack_does_not_own_is_refused_naming_it(pack, hub, tmp_path, capsys,
                                                                                 make, name, what):
    copy = shutil.copytree(pack, tmp_path / "pack")
    make(copy)
    before = _state(copy)
    for extra in (["--dry-run"], []):
        assert main(["publish", str(copy), "--repo", REPO, *extra]) == 2
        one_line(capsys.readouterr().err, f"holds what the pack does not own: {name} ({what})", "move them out")
    assert main(["verify", str(copy)]) == 1
    assert f"FAULT {name}: " in capsys.readouterr().out
    assert hub.calls == [] and _state(copy) == before  # nothing uploaded, nothing of the user's changed


def test_hidden_entries_such_as_the_uploads_resume_records_are_not_part_of_the_pack(pack, hub, tmp_path, capsys):
    copy = shutil.copytree(pack, tmp_path / "pack")
    (copy / ".cache" / "huggingface").mkdir(parents=True)  # where upload_large_folder keeps its progress
    assert main(["verify", str(copy)]) == 0
    assert main(["publish", str(copy), "--repo", REPO]) == 0
    assert sorted(hub.calls[-1][1]["allow_patterns"]) == owned_files(Manifest.load(copy))


def test_a_pack_that_fails_verify_is_refused_in_one_line(pack, hub, tmp_path, capsys):
    broken = shutil.copytree(pack, tmp_path / "pack")
    shard = sorted(broken.glob("*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 100)
    for extra in ([], ["--dry-run"]):
        assert main(["publish", str(broken), "--repo", REPO, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "verify finds" in err[0] and shard.name in err[0] and "not published" in err[0]
    assert hub.calls == []


def test_no_token_is_one_line_and_exit_2(pack, hub, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert main(["publish", str(pack), "--repo", REPO]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Hugging Face token" in err[0] and "hf auth login" in err[0]
    assert hub.calls == []


@pytest.mark.parametrize("flag, value", [
    ("--repo", "just-a-name"), ("--repo", "../x"), ("--repo", "org/-bad-"), ("--repo", "org/na..me"),
    ("--repo", "a b/c"), ("--repo", "org/na\nme"), ("--repo", "org/name/extra"),
    ("--revision", "../x"), ("--revision", "x..y"), ("--revision", "a b"), ("--revision", ""),
    ("--revision", "main."), ("--revision", "x.lock"), ("--revision", "x\ny"),
])
def test_repo_ids_and_branch_names_the_hub_would_refuse_are_refused_while_the_arguments_are_read(
        pack, flag, value, capsys):
    argv = ["publish", str(pack), "--repo", REPO, "--dry-run", flag, value]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    one_line(capsys.readouterr().err, f"argument {flag}: {value!r}: a ")


def test_good_repo_ids_and_branch_names_pass(capsys):
    for repo, branch in (("example-org/tiny.v41_exl3", "2.9bpw"), ("a/b", "exl3/2.9-bpw"), ("A1/B-2", "main")):
        args = build_parser().parse_args(["publish", "p", "--repo", repo, "--revision", branch])
        assert (args.repo, args.revision) == (repo, branch)


def test_upload_creates_repo_and_branch_and_uploads_exactly_the_pack(pack, hub, capsys):
    assert main(["publish", str(pack), "--repo", REPO, "--revision", "2.9bpw", "--private"]) == 0
    files = sorted(p.name for p in pack.iterdir())
    assert hub.calls[0] == ("init", "hf_test_token")
    assert hub.calls[1] == ("create_repo", REPO, {"repo_type": "model", "private": True, "exist_ok": True})
    assert hub.calls[2] == ("create_branch", REPO, {"branch": "2.9bpw", "repo_type": "model", "exist_ok": True})
    name, kw = hub.calls[3]
    assert name == "upload_folder" and kw["repo_id"] == REPO and kw["revision"] == "2.9bpw"
    assert kw["folder_path"] == pack and sorted(kw["allow_patterns"]) == files and kw["repo_type"] == "model"
    assert len(hub.calls) == 4
    assert f"published {pack} to https://huggingface.co/{REPO} (branch 2.9bpw)" in capsys.readouterr().out


def test_older_huggingface_hub_uploads_with_upload_large_folder_on_main(pack, hub, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub, "HfApi", OldHub)
    assert main(["publish", str(pack), "--repo", REPO]) == 0
    names = [c[0] for c in hub.calls]
    assert names == ["init", "create_repo", "upload_large_folder"]  # no branch asked for, none created
    kw = hub.calls[-1][1]
    assert kw["revision"] is None and kw["private"] is False
    assert sorted(kw["allow_patterns"]) == sorted(p.name for p in pack.iterdir())


def _hub_error(status: int, message: str | None = None):
    """The exception huggingface_hub itself raises for this answer of the hub (its own status mapping)."""
    response = httpx2.Response(status, headers={"X-Error-Message": message} if message else {},
                               request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
    try:
        hf_raise_for_status(response)
    except Exception as e:  # noqa: BLE001 - the error under test
        return e
    raise AssertionError("no error for this response")


class FailingHub(Hub):
    """The Hub answering every call of `call` with `error`."""

    call, error = "create_repo", None

    def create_repo(self, repo_id, **kw):
        return self._maybe_fail("create_repo") or super().create_repo(repo_id, **kw)

    def create_branch(self, repo_id, **kw):
        return self._maybe_fail("create_branch") or super().create_branch(repo_id, **kw)

    def upload_folder(self, **kw):
        return self._maybe_fail("upload_folder") or super().upload_folder(**kw)

    def _maybe_fail(self, call):
        if call == self.call:
            raise self.error()


@pytest.mark.parametrize("call, error, needles", [
    ("create_repo", lambda: httpx2.ConnectError("[Errno -3] Temporary failure in name resolution"),
     ("cannot reach the Hugging Face Hub (ConnectError: [Errno -3]", "check the network connection")),
    ("create_repo", lambda: ConnectionError("Connection refused"), ("cannot reach the Hugging Face Hub",)),
    ("create_repo", lambda: OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/repos/create: offline mode "
                                                 "is enabled."), ("offline mode (HF_HUB_OFFLINE is set)",)),
    ("create_repo", lambda: _hub_error(400, "Invalid repo name"),
     ("rejected the request (HTTP 400: Invalid repo name); check the repository id and branch name",)),
    ("create_repo", lambda: _hub_error(401), ("refused it (HTTP 401)", "hf auth login")),
    ("create_repo", lambda: _hub_error(403), ("refused it (HTTP 403)", "write access")),
    ("create_branch", lambda: _hub_error(400, "Invalid reference for a branch"), ("branch 2.9bpw", "HTTP 400")),
    ("upload_folder", lambda: _hub_error(500), ("the hub failed (HTTP 500); try again later (a rerun resumes)",)),
    ("upload_folder", lambda: httpx2.ReadTimeout("The read operation timed out"), ("ReadTimeout",)),
])
def test_each_failure_of_the_hub_is_one_line_and_exit_2(pack, hub, monkeypatch, capsys, call, error, needles):
    monkeypatch.setattr(FailingHub, "call", call)
    monkeypatch.setattr(FailingHub, "error", staticmethod(error))
    monkeypatch.setattr(huggingface_hub, "HfApi", FailingHub)
    before = _state(pack)
    assert main(["publish", str(pack), "--repo", REPO, "--revision", "2.9bpw"]) == 2
    one_line(capsys.readouterr().err, f"error: upload to {REPO} branch 2.9bpw: ", *needles)
    assert _state(pack) == before


def test_offline_mode_is_refused_before_verify_and_the_hub_refuses_it_too(pack, hub, monkeypatch, capsys):
    """HF_HUB_OFFLINE set: refused before a verify that may hash hundreds of GiB; and the real HfApi, which
    refuses every request in offline mode without touching the network, gives one line as well."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("quantizer.publish.hub_upload.verify_pack", lambda *a, **k: pytest.fail("verified"))
    assert main(["publish", str(pack), "--repo", REPO]) == 2
    one_line(capsys.readouterr().err, "offline mode (HF_HUB_OFFLINE is set)", "unset HF_HUB_OFFLINE")
    assert hub.calls == []
    monkeypatch.undo()
    plan = plan_publish(pack, REPO)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=f"upload to {REPO}: huggingface_hub is in offline mode"):
        upload(plan, "hf_test_token")  # huggingface_hub's own HfApi
