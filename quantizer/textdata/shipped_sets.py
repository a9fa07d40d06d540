"""The text sets and tokenizer shipped in `calibration/` (see calibration/PROVENANCE.md).

`calibration` is the default calibration text, `heldout` the default perplexity/KL text (of the
same kinds as calibration: library code, reference-manual prose, Wikipedia), `heldout-tests` a
second held-out text of another kind (CPython's test suites), so a gain measured on it is not one
fitted to calibration's kind of text, and `train` the small model's training text; they share no
document. The train set stays in the repository only (the wheel would grow by its size for no
user's benefit), so it is found in a source checkout.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from quantizer.errors import UserError
from quantizer.shipped import shipped
from quantizer.textdata.files import read_texts
from quantizer.textdata.tokenizer import load_tokenizer

SET_FILES = {"train": "train.jsonl.zst", "calibration": "calibration.jsonl", "heldout": "heldout.jsonl",
             "heldout-tests": "heldout_tests.jsonl"}
TOKENIZER_FILE = "tokenizer.json"


def _shipped_file(name: str) -> Path:
    try:
        path = shipped("calibration", name)
    except FileNotFoundError as e:
        raise UserError(f"{e}; reinstall quantizer") from None
    if not path.is_file():
        hint = "it is kept in the source repository only; use a checkout" if name == SET_FILES["train"] else "reinstall quantizer"
        raise UserError(f"{path}: shipped file is missing; {hint}")
    return path


def shipped_text_path(name: str) -> Path:
    """Where a shipped set lives: `name` is one of SET_FILES ("calibration", "heldout", "heldout-tests", "train")."""
    if name not in SET_FILES:
        raise UserError(f"unknown text set {name!r}; shipped sets are {', '.join(SET_FILES)}")
    return _shipped_file(SET_FILES[name])


def text_argument(value: str | Path) -> Path:
    """What `--text` names: an existing file, else a shipped set by name (`--text heldout-tests`).

    A file wins over a set of the same name, so a user's own `heldout` file is still read as given."""
    path = Path(value)
    if str(value) in SET_FILES and not path.is_file():
        return shipped_text_path(str(value))
    if not path.exists():
        raise UserError(f"{value}: no such file, and not a shipped text set ({', '.join(SET_FILES)}); "
                        "check the path or the set name")
    return path


def calibration_text(value: str | None) -> Path:
    """The text `calibrate` and `build` read: their `--text` (a file or a set name), else the shipped calibration set."""
    return text_argument(value) if value else shipped_text_path("calibration")


def default_text(name: str) -> list[str]:
    """The documents of a shipped set."""
    return read_texts(shipped_text_path(name))


def shipped_tokenizer_path() -> Path:
    """The byte-level BPE trained on the train set (training/tokenizer.py), the small models' tokenizer."""
    return _shipped_file(TOKENIZER_FILE)


def default_tokenizer() -> Tokenizer:
    return load_tokenizer(shipped_tokenizer_path())
