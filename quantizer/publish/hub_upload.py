"""Upload a pack to the Hugging Face Hub, only once `verify` finds it clean.

What is uploaded is exactly the files the pack owns (pack/owned.py: the shards, manifest, card and
the files the manifest records), never anything else in its folder: a pack that holds a stray file,
directory or symbolic link is refused, naming them (hidden entries, such as the upload's own resume
records in `.cache/`, are not part of the pack). The upload resumes when rerun after an interruption:
huggingface_hub before 2.0 does that in `upload_large_folder`, 2.x in `upload_folder` itself
(docs/publishing.md has the sources). One branch per pack (`--revision`) keeps several bit rates in
one repository. A hub that cannot be reached, is switched off (HF_HUB_OFFLINE) or refuses the upload
is one line (quantizer/hub.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantizer.errors import UserError
from quantizer.hub import LOGIN, hub_failures
from quantizer.pack.card import CARD_NAME
from quantizer.pack.manifest import Manifest
from quantizer.pack.owned import owned_files, strays
from quantizer.verify.checks import verify_pack

REPO_TYPE = "model"


@dataclass(frozen=True)
class PackFile:
    name: str
    bytes: int


@dataclass(frozen=True)
class PublishPlan:
    pack: Path
    repo: str
    revision: str | None
    private: bool
    files: list[PackFile]
    card: str

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def pack_files(pack: Path) -> list[PackFile]:
    """The files the pack owns, in name order, as they are (a link is not followed)."""
    pack = Path(pack)
    return [PackFile(name, (pack / name).lstat().st_size) for name in owned_files(Manifest.load(pack))]


def plan_publish(pack: Path, repo: str, revision: str | None = None, private: bool = False,
                 full: bool = False) -> PublishPlan:
    """What would be uploaded; UserError unless `pack` holds only its own files and verifies clean
    (`full`: shard hashes too)."""
    pack = Path(pack)
    if not pack.is_dir():
        raise UserError(f"{pack}: not a directory; pass the pack directory that holds manifest.json")
    found = strays(pack, owned_files(Manifest.load(pack)))
    if found:
        raise UserError(f"{pack}: holds what the pack does not own: "
                        + ", ".join(f"{name} ({what})" for name, what in found.items())
                        + "; move them out of the pack (publish uploads only the files its manifest names)")
    report = verify_pack(pack, full=full)
    if report.faults:
        raise UserError(f"{pack}: verify finds {len(report.faults)} fault(s), first {report.faults[0].line()}; "
                        f"a pack that does not verify is not published (run `quantizer verify {pack}`)")
    return PublishPlan(pack, repo, revision, private, pack_files(pack), (pack / CARD_NAME).read_text())


def hub_token() -> str:
    """The token huggingface_hub would use (HF_TOKEN, or the one `hf auth login` saved); refused at once,
    before a verify that may hash hundreds of GiB, when there is none or the hub is switched off."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UserError("huggingface_hub is in offline mode (HF_HUB_OFFLINE is set), so nothing can be uploaded; "
                        "unset HF_HUB_OFFLINE and rerun (or use --dry-run)")
    token = get_token()
    if not token:
        raise UserError(f"no Hugging Face token: {LOGIN}, then rerun (or use --dry-run)")
    return token


def upload(plan: PublishPlan, token: str) -> str:
    """Create the repository (and branch) if needed, upload the pack's files; returns the repository URL.
    A failure of the hub or of the way to it is one line (a rerun resumes the upload)."""
    from huggingface_hub import HfApi

    where = f"upload to {plan.repo}" + (f" branch {plan.revision}" if plan.revision else "")
    with hub_failures(where):
        api = HfApi(token=token)
        url = api.create_repo(plan.repo, repo_type=REPO_TYPE, private=plan.private, exist_ok=True)
        if plan.revision:
            api.create_branch(plan.repo, branch=plan.revision, repo_type=REPO_TYPE, exist_ok=True)
        names = [f.name for f in plan.files]
        large = getattr(api, "upload_large_folder", None)
        if large is not None:  # huggingface_hub < 2: the resumable uploader is its own call
            large(repo_id=plan.repo, folder_path=plan.pack, repo_type=REPO_TYPE, revision=plan.revision,
                  private=plan.private, allow_patterns=names)
        else:  # huggingface_hub 2.x: upload_folder resumes an interrupted upload itself (with hf_xet)
            api.upload_folder(repo_id=plan.repo, folder_path=plan.pack, repo_type=REPO_TYPE, revision=plan.revision,
                              allow_patterns=names, commit_message=f"Upload {plan.pack.name} (quantizer publish)")
    return str(url)
