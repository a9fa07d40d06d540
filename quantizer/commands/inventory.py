"""`quantizer inspect SRC [--json]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantizer.checkpoint.source import Checkpoint
from quantizer.commands.arguments import revision
from quantizer.inventory.classify import refuse_pack, take_inventory


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="classify every tensor of a native checkpoint and check it against its config")
    p.add_argument("src", help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--revision", type=revision, help="revision of a Hugging Face repo id")
    p.add_argument("--no-engram", action="store_true", help="leave the Engram table shards out")
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if Path(args.src).is_dir():
        refuse_pack(Path(args.src))
    ck = Checkpoint.open(args.src, args.revision, include_engram=not args.no_engram)
    refuse_pack(ck.root)
    inv = take_inventory(ck)
    print(inv.to_json() if args.json else inv.render())
    return 1 if inv.problems else 0
