"""Text and token inputs: the one place that turns user text, JSONL or token files into token rows.

`calibrate`, `ppl` and the small model's training read their tokens through `rows_from_file` (or
`default_text` for the sets shipped in `calibration/`), so every stage accepts the same inputs and
reports bad ones the same way.
"""

from quantizer.textdata.files import read_texts, read_tokens
from quantizer.textdata.rows import check_ids, model_rows, rows_from_file, token_rows
from quantizer.textdata.shipped_sets import (
    SET_FILES,
    calibration_text,
    default_text,
    default_tokenizer,
    shipped_text_path,
    shipped_tokenizer_path,
    text_argument,
)
from quantizer.textdata.tokenizer import SPECIAL_TOKENS, encode_texts, load_tokenizer

__all__ = [
    "SET_FILES",
    "SPECIAL_TOKENS",
    "calibration_text",
    "check_ids",
    "default_text",
    "default_tokenizer",
    "encode_texts",
    "load_tokenizer",
    "model_rows",
    "read_texts",
    "read_tokens",
    "rows_from_file",
    "shipped_text_path",
    "shipped_tokenizer_path",
    "text_argument",
    "token_rows",
]
