"""`quantizer ppl SRC (--text FILE | --tokens FILE)`: perplexity of a native checkpoint.

Rows are cut by quantizer.textdata: text is tokenized with the checkpoint's tokenizer.json, one BOS
per row and EOS between documents; token files (.npy, or .safetensors with `input_ids`) are used
as given (1-D: cut into rows of --cols; 2-D: taken as rows). The model is streamed layer by layer,
in float32 on the CPU or bfloat16 on CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.ppl.perplexity import perplexity
from quantizer.textdata import load_tokenizer, read_tokens, rows_from_file

DEFAULT_COLS = 512


def register(subparsers) -> None:
    p = subparsers.add_parser("ppl", help="perplexity of a native checkpoint over text or token ids",
                              description=__doc__.splitlines()[0])
    p.add_argument("src", metavar="SRC", help="native checkpoint directory or Hugging Face repo id")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--text", metavar="FILE", help="text (.txt, .jsonl, optionally .zst), tokenized with SRC's tokenizer.json")
    given.add_argument("--tokens", metavar="FILE", help="token ids: .npy, or .safetensors with key input_ids (1-D or 2-D)")
    p.add_argument("--rows", type=int, help="use at most this many rows (default: all)")
    p.add_argument("--cols", type=int, help=f"tokens per row (default: a 2-D file's width, else {DEFAULT_COLS})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--revision", help="revision, for a Hugging Face repo id")
    p.add_argument("--json", action="store_true", help='print {"ppl", "nll", "nll_stderr", "tokens"} as JSON')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    ck = Checkpoint.open(args.src, revision=args.revision)
    rows = _rows(args, ck)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    streamer = LayerStreamer(CheckpointSource(ck), device=args.device, dtype=dtype)
    result = perplexity(streamer, rows)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"perplexity {result.ppl:.4f}  mean NLL {result.nll:.5f} ± {result.nll_stderr:.5f} (per-token "
              f"standard error)  over {result.tokens:,} predicted tokens in {rows.shape[0]} rows of {rows.shape[1]}")
    return 0


def _rows(args: argparse.Namespace, ck: Checkpoint) -> torch.Tensor:
    cfg = ck.config
    if args.text:
        if not (ck.root / "tokenizer.json").exists():
            raise UserError(f"{ck.root}: has no tokenizer.json, so --text cannot be tokenized; pass token ids with --tokens")
        rows = rows_from_file(args.text, args.rows, args.cols or DEFAULT_COLS, tokenizer=load_tokenizer(ck.root),
                              bos=cfg.bos_token_id, eos=cfg.eos_token_id, vocab_size=cfg.vocab_size)
    else:
        if not args.tokens.lower().endswith((".npy", ".safetensors")):
            raise UserError(f"{args.tokens}: --tokens takes a .npy or .safetensors file; use --text for text")
        cols = args.cols
        if cols is None:
            ids = read_tokens(args.tokens, cfg.vocab_size)
            cols = ids.shape[1] if ids.dim() == 2 else DEFAULT_COLS
        rows = rows_from_file(args.tokens, args.rows, cols, vocab_size=cfg.vocab_size)
    if rows.shape[1] < 2:
        raise UserError(f"{args.text or args.tokens}: rows of {rows.shape[1]} token leave nothing to predict; use --cols 2 or more")
    print(f"ppl: {rows.shape[0]} rows of {rows.shape[1]} tokens", file=sys.stderr)
    return rows
