"""`quantizer publish PACK --repo ORG/NAME [--revision BRANCH] [--private] [--dry-run] [--full]`

Refuses a pack whose folder holds anything it does not own (a stray file or directory, a symbolic
link: named in the one line), verifies it (header level; --full hashes every shard too) and refuses one
with a fault, then uploads exactly the files its manifest names to the Hugging Face model repository
(created if missing; --revision: the branch, created from main if missing). --repo and --revision are
refused while the arguments are read when the hub would refuse them. --dry-run prints every file with
its size and the card, and uploads nothing. A rerun resumes an interrupted upload; a hub that cannot be
reached, is in offline mode or refuses the upload is one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantizer.commands.arguments import repo_id, revision
from quantizer.publish.hub_upload import PublishPlan, hub_token, plan_publish, upload
from quantizer.report import size_text, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="verify a pack and upload it, with its card, to a Hugging Face repository")
    p.add_argument("pack", type=Path, help="pack directory (holds manifest.json and README.md)")
    p.add_argument("--repo", type=repo_id, required=True, metavar="ORG/NAME", help="Hugging Face model repository")
    p.add_argument("--revision", type=revision, metavar="BRANCH",
                   help="branch to upload to (e.g. one per bit rate; default main)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--full", action="store_true", help="verify shard hashes too before uploading")
    p.add_argument("--dry-run", action="store_true", help="print the files and the card; upload nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    token = None if args.dry_run else hub_token()  # before a verify that may hash hundreds of GiB
    plan = plan_publish(args.pack, args.repo, args.revision, args.private, args.full)
    print(describe(plan))
    if args.dry_run:
        print(f"\n--- {plan.pack / 'README.md'} ---\n{plan.card}")
        return 0
    url = upload(plan, token)
    print(f"published {plan.pack} to {url}" + (f" (branch {plan.revision})" if plan.revision else ""))
    return 0


def describe(plan: PublishPlan) -> str:
    where = f"{plan.repo}" + (f" branch {plan.revision}" if plan.revision else "") + (" (private)" if plan.private else "")
    rows = [[f.name, f"{f.bytes:,}"] for f in plan.files]
    return "\n".join([f"{plan.pack}: verified clean; {len(plan.files)} files, {size_text(plan.total_bytes)} to {where}:",
                      table(["file", "bytes"], rows)])
