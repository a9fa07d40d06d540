"""`quantizer make-tiny OUT --arch v41|v4 [--seed N] [--tokenizer] [--full-size --sparse]`."""

from __future__ import annotations

import argparse

from quantizer.commands.arguments import out_dir
from quantizer.tiny.make import make_tiny


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a small random native checkpoint, or the full-size layout as sparse files")
    p.add_argument("out", type=out_dir, help="output directory (must not exist or be empty)")
    p.add_argument("--arch", choices=["v41", "v4"], default="v41")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", action="store_true",
                   help="v41: also write the shipped tokenizer.json, with the Engram hash's compressed vocabulary sized to "
                        "it: what a one-Spark build (--loader exllamav3-v41) reads (a tiny v4 always has it)")
    p.add_argument("--full-size", action="store_true", help="the real model's layout (V4.1-Flash or V4-Flash-0731)")
    p.add_argument("--sparse", action="store_true", help="write headers and leave the data as holes (no disk used)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = make_tiny(args.out, args.arch, args.seed, args.full_size, args.sparse, args.tokenizer)
    print(f"wrote {out}")
    return 0
