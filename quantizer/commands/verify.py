"""`quantizer verify PACK [--full] [--loader PROFILE]`: exit 0 when clean, 1 on any fault, 2 when PACK is not a pack."""

from __future__ import annotations

import argparse

from quantizer.commands.arguments import profile_arg
from quantizer.verify.checks import verify_pack


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a pack against its manifest (headers, alignment, index, K; --full: sha256)")
    p.add_argument("pack", help="pack directory (holds manifest.json)")
    p.add_argument("--full", action="store_true", help="also hash every shard and compare with the manifest")
    p.add_argument("--loader", type=profile_arg, metavar="PROFILE",
                   help="check the pack against this loader profile's rules (default: the one it was made for)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = verify_pack(args.pack, full=args.full, profile=args.loader)
    print(report.render())
    return 1 if report.faults else 0
