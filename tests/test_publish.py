"""`quantizer publish`: only a pack that verifies is published, exactly its files are uploaded (card
included) to the repository and branch asked for, --dry-run shows the files and the card, and a
missing token is one line. The Hub is replaced by a recorder: no network."""

from __future__ import annotations

import os
import shutil

import huggingface_hub
import pytest

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.model.targets import targets
from quantizer.pack.card import CARD_NAME
from quantizer.plan.plan import make_plan

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
    return Hub


def _listed(out: str) -> dict[str, int]:
    """file -> bytes from the table publish prints (up to the card)."""
    table = out.split("\n--- ")[0].splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("file ")) + 2
    return {name: int(size.replace(",", "")) for name, size in (line.split() for line in table[start:])}


def test_dry_run_lists_exactly_the_packs_files_and_prints_the_card(pack, hub, capsys):
    assert main(["publish", str(pack), "--repo", REPO, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _listed(out) == {p.name: p.stat().st_size for p in pack.iterdir()}
    assert CARD_NAME in _listed(out) and "manifest.json" in _listed(out)
    assert out.rstrip().endswith((pack / CARD_NAME).read_text().rstrip())
    assert hub.calls == []  # nothing touched the Hub


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


def test_a_repo_that_is_not_org_slash_name_is_refused(pack, hub, capsys):
    assert main(["publish", str(pack), "--repo", "just-a-name", "--dry-run"]) == 2
    assert "ORG/NAME" in capsys.readouterr().err


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
