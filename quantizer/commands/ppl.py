"""`quantizer ppl MODEL [--against SRC] (--text FILE|SET | --tokens FILE)`: perplexity, and what a pack costs.

MODEL is a native checkpoint or a pack written by quantizer (its EXL3 linears are decoded to the
weights a loader computes with). With `--against SRC` both run over the same rows and the report
adds KL(SRC || MODEL) (mean and 95th percentile over the tokens), top-1 agreement, the perplexity ratio
(MODEL / SRC) and the paired NLL delta with its standard error; a pack is compared only with the
checkpoint its manifest says it was built from (same content fingerprint).
A pack is measured only once every shard's sha256 matches its manifest (a flipped byte would give a
plausible, wrong number); a model that computes NaN or inf is an error (exit 2) naming what verify finds.
`--record` writes that measurement into the pack's manifest and regenerates its card (pack/card.py).

`--text` takes a file or the name of a shipped set: `heldout` (text of the calibration set's kinds)
or `heldout-tests` (CPython's test suites, another kind: a gain there is not fitted to calibration's
kind of text); a file of that name in the working directory wins.

Rows are cut by quantizer.textdata: text is tokenized with the checkpoint's tokenizer.json, one BOS
per row and EOS between documents; token files (.npy, or .safetensors with `input_ids`) are used
as given (1-D: cut into rows of --cols; 2-D: taken as rows). The model is streamed layer by layer,
in float32 on the CPU or bfloat16 on CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from quantizer import __version__
from quantizer.checkpoint.fingerprint import sha256_file
from quantizer.checkpoint.source import Checkpoint
from quantizer.commands.arguments import add_device_argument, revision
from quantizer.errors import UserError
from quantizer.pack.card import CARD_NAME, record_measurement
from quantizer.pack.manifest import MANIFEST_NAME, is_pack
from quantizer.pack.measurement import LogitsEngine, Measurement
from quantizer.ppl.compare import Comparison, compare
from quantizer.ppl.measure import forward_dtype, open_measured, streamer
from quantizer.ppl.perplexity import NonFiniteLogits, perplexity, row_predictions
from quantizer.textdata import SET_FILES, model_rows, text_argument
from quantizer.verify.checks import verify_pack

DEFAULT_COLS = 512


def register(subparsers) -> None:
    p = subparsers.add_parser("ppl", help="perplexity of a checkpoint or pack; with --against, KL and NLL delta",
                              description=__doc__.splitlines()[0])
    p.add_argument("src", metavar="MODEL", help="pack directory, native checkpoint directory or Hugging Face repo id")
    p.add_argument("--against", metavar="SRC", help="the native checkpoint MODEL was made from: compare the two")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--text", metavar="FILE|SET", help="text (.txt, .jsonl, optionally .zst) or a shipped set "
                       f"({', '.join(SET_FILES)}), tokenized with SRC's tokenizer.json")
    given.add_argument("--tokens", metavar="FILE", help="token ids: .npy, or .safetensors with key input_ids (1-D or 2-D)")
    p.add_argument("--rows", type=int, help="use at most this many rows (default: all)")
    p.add_argument("--cols", type=int, help=f"tokens per row (default: a 2-D file's width, else {DEFAULT_COLS})")
    add_device_argument(p, "where the model (and with --against its source) runs: cpu in float32, cuda in bfloat16")
    p.add_argument("--revision", type=revision, help="revision, for a Hugging Face repo id")
    p.add_argument("--record", action="store_true",
                   help="with --against and a pack: write the measurement into the pack's manifest and card")
    p.add_argument("--json", action="store_true", help='print {"ppl", "nll", "nll_stderr", "tokens"} as JSON '
                   '(with --against: "ppl", "ppl_source", "ppl_ratio", "kl", "kl_p95", "top1", "nll_delta", '
                   '"nll_delta_stderr", "tokens", ...)')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    if args.text:  # a file or a shipped set's name, resolved before any model is opened
        args.text = text_argument(args.text)
    if args.record and not (args.against and is_pack(args.src)):
        raise UserError("--record writes into a pack: give a local pack directory as MODEL and its source as --against")
    model, reference = open_measured(args.src, args.against, args.revision)
    try:
        return _report(args, model, reference)
    except NonFiniteLogits as e:
        raise UserError(f"{args.src}: {e}" + (_first_fault(model.root) if is_pack(model.root) else "")) from None


def _first_fault(pack) -> str:
    """What verify finds first in a pack that computed NaN (its shards' sha256 were checked already)."""
    faults = verify_pack(pack).faults
    return f"; verify: {faults[0].line()}" if faults else f"; its shards match the manifest and verify finds no fault in {pack}"


def _report(args: argparse.Namespace, model: Checkpoint, reference: Checkpoint | None) -> int:
    rows = _rows(args, reference or model)
    if reference is not None:
        if reference.config.vocab_size != model.config.vocab_size:
            raise UserError(f"{args.src} and {args.against} have different vocabularies; compare a pack with its source")
        result = compare(row_predictions(streamer(reference, args.device), rows, bar=False),  # one rows bar: MODEL's
                         row_predictions(streamer(model, args.device), rows))
        print(json.dumps(result.as_dict()) if args.json else describe(result))
        if args.record:
            record_measurement(model.root, measurement(result, rows, Path(args.text or args.tokens), args.device))
            print(f"ppl: recorded in {model.root / MANIFEST_NAME} and {model.root / CARD_NAME}", file=sys.stderr)
        return 0
    result = perplexity(streamer(model, args.device), rows)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"perplexity {result.ppl:.4f}  mean NLL {result.nll:.5f} ± {result.nll_stderr:.5f} (per-token "
              f"standard error)  over {result.tokens:,} predicted tokens in {rows.shape[0]} rows of {rows.shape[1]}")
    return 0


def describe(c: Comparison) -> str:
    return (f"perplexity {c.pack.ppl:.4f} (source {c.source.ppl:.4f}, ratio {c.ppl_ratio:.4f})  "
            f"KL {c.kl:.5f} ± {c.kl_stderr:.5f} (p95 {c.kl_p95:.5f})  top-1 agreement {c.top1:.2%}  "
            f"NLL delta {c.nll_delta:+.5f} ± {c.nll_delta_stderr:.5f}  "
            f"over {c.tokens:,} tokens")


def measurement(c: Comparison, rows: torch.Tensor, text: Path, device: str) -> Measurement:
    """The comparison as the manifest records it: the rows' file by name and hash, our forward as the engine."""
    dtype = str(forward_dtype(device)).removeprefix("torch.")
    engine = LogitsEngine("quantizer reference forward", __version__, device, dtype)
    return Measurement(text.name, sha256_file(text), rows.shape[0], rows.shape[1], c.tokens, c.kl, c.kl_stderr,
                       c.top1, c.top1_stderr, c.pack.ppl, c.source.ppl, c.nll_delta, c.nll_delta_stderr, engine,
                       kl_p95=c.kl_p95)


def _rows(args: argparse.Namespace, ck: Checkpoint) -> torch.Tensor:
    rows = model_rows(ck.root, ck.config, text=args.text, tokens=args.tokens, rows=args.rows, cols=args.cols,
                      default_cols=DEFAULT_COLS)
    if rows.shape[1] < 2:
        raise UserError(f"{args.text or args.tokens}: rows of {rows.shape[1]} token leave nothing to predict; "
                        "use --cols 2 or more")
    print(f"ppl: {rows.shape[0]} rows of {rows.shape[1]} tokens", file=sys.stderr)
    return rows
