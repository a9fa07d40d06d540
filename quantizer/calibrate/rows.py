"""The token rows `calibrate` and `build` calibrate on, as both commands read them."""

from __future__ import annotations

import sys

import torch

from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS
from quantizer.checkpoint.source import Checkpoint
from quantizer.distributed import current
from quantizer.textdata import calibration_text, model_rows


def calibration_rows(ck: Checkpoint, text: str | None, tokens: str | None, rows: int | None, cols: int | None
                     ) -> torch.Tensor:
    """The rows `calibrate` and `build` calibrate on: `rows` of the text or token file, else as many as it
    holds up to DEFAULT_ROWS. Says how many on stderr, and when the default found fewer than it takes, that
    more text helps (docs/calibration.md, "How much calibration text")."""
    got = model_rows(ck.root, ck.config, text=None if tokens else calibration_text(text), tokens=tokens,
                     rows=rows, cols=cols, default_cols=DEFAULT_COLS)
    if rows is None:
        got = got[:DEFAULT_ROWS]
    line = f"calibrate: {got.shape[0]} rows of {got.shape[1]} tokens"
    if rows is None and got.shape[0] < DEFAULT_ROWS:
        line += (f", all the {'token file' if tokens else 'text'} holds (the default takes up to {DEFAULT_ROWS}); "
                 "more text of the kinds the pack will serve lowers its KL (docs/calibration.md, How much calibration text)")
    if current().main:
        print(line, file=sys.stderr)
    return got
