"""`quantizer card PACK`: write the pack's model card (README.md) from its manifest.

`build` writes the card and `ppl --record` rewrites it; this command is for a pack written before
quantizer wrote cards, or one whose README.md was edited (verify names both).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantizer.errors import UserError
from quantizer.pack.card import write_card


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("card", help="write a pack's model card (README.md) from its manifest")
    p.add_argument("pack", type=Path, help="pack directory (holds manifest.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.pack.is_dir():
        raise UserError(f"{args.pack}: not a directory; pass the pack directory that holds manifest.json")
    print(write_card(args.pack))
    return 0
