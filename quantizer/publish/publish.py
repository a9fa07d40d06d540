"""Upload a pack to the Hugging Face Hub, only once `verify` finds it clean.

What is uploaded is exactly the pack's files (every regular top-level file but hidden ones, such as
the upload's own resume records), card included. The upload resumes when rerun after an interruption:
huggingface_hub before 2.0 does that in `upload_large_folder`, 2.x in `upload_folder` itself
(docs/publishing.md has the sources). One branch per pack (`--revision`) keeps several bit rates in
one repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantizer.errors import UserError
from quantizer.pack.card import CARD_NAME
from quantizer.verify.verify import verify_pack

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
    """The files a pack consists of, in name order."""
    return [PackFile(p.name, p.stat().st_size) for p in sorted(Path(pack).iterdir())
            if p.is_file() and not p.name.startswith(".")]


def plan_publish(pack: Path, repo: str, revision: str | None = None, private: bool = False,
                 full: bool = False) -> PublishPlan:
    """What would be uploaded; UserError unless `pack` verifies clean (`full`: shard hashes too)."""
    pack = Path(pack)
    _check_repo_id(repo)
    report = verify_pack(pack, full=full)
    if report.faults:
        raise UserError(f"{pack}: verify finds {len(report.faults)} fault(s), first {report.faults[0].line()}; "
                        f"a pack that does not verify is not published (run `quantizer verify {pack}`)")
    return PublishPlan(pack, repo, revision, private, pack_files(pack), (pack / CARD_NAME).read_text())


def _check_repo_id(repo: str) -> None:
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(c.isspace() for c in repo):
        raise UserError(f"--repo {repo!r}: give the Hugging Face repository as ORG/NAME")


def hub_token() -> str:
    """The token huggingface_hub would use (HF_TOKEN, or the one `hf auth login` saved)."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserError("no Hugging Face token: run `hf auth login` or set HF_TOKEN, then rerun (or use --dry-run)")
    return token


def upload(plan: PublishPlan, token: str) -> str:
    """Create the repository (and branch) if needed, upload the pack's files; returns the repository URL."""
    from huggingface_hub import HfApi

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
