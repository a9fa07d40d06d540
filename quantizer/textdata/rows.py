"""Token rows: the [rows, cols] batches that calibration, perplexity and training consume."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from quantizer.errors import UserError
from quantizer.textdata.files import TOKEN_SUFFIXES, check_ids, read_texts, read_tokens
from quantizer.textdata.tokenizer import encode_texts, load_tokenizer


def token_rows(
    ids: torch.Tensor, rows: int | None, cols: int, bos: int | None = None, where: str = "token stream"
) -> torch.Tensor:
    """Cut a 1-D stream into consecutive, non-overlapping rows of `cols` tokens, from its start.

    With `bos`, each row is `bos` followed by the next cols-1 stream tokens. `rows=None` takes every
    full row the stream holds; a row count the stream cannot fill is a UserError that names how
    many tokens it needs (rows are never silently fewer than asked). A partial last row is dropped.
    """
    if ids.dim() != 1:
        raise UserError(f"{where}: expected a 1-D token stream, got shape {list(ids.shape)}")
    per_row = cols - (bos is not None)
    if per_row < 1:
        raise UserError(f"{where}: rows of {cols} tokens leave no room for text; use more columns")
    if rows is not None and rows < 1:
        raise UserError(f"{where}: asked for {rows} rows; ask for at least one")
    available = ids.numel() // per_row
    wanted = rows if rows is not None else max(available, 1)
    if available < wanted:
        raise UserError(
            f"{where}: {ids.numel():,} tokens, but {wanted} rows of {cols} need {wanted * per_row:,}; "
            "give more text or ask for fewer rows"
        )
    body = ids[: wanted * per_row].reshape(wanted, per_row).to(torch.int64)
    if bos is None:
        return body
    return torch.cat([torch.full((wanted, 1), bos, dtype=torch.int64), body], dim=1)


def rows_from_file(
    path: str | os.PathLike,
    rows: int | None,
    cols: int,
    *,
    tokenizer: Tokenizer | None = None,
    bos: int | None = None,
    eos: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Token rows from whatever the user passed: text (.txt, .jsonl, optionally .zst), tokenized
    with `tokenizer` (documents separated by `eos`), or a token file (.npy, .safetensors).

    A 1-D token file is a stream, cut like text. A 2-D token file is already rows: they are taken
    as they are (no `bos` added), its width must equal `cols`, and `rows` takes the first ones.
    With `vocab_size`, every id must lie below it.
    """
    path = Path(path)
    where = str(path)
    if path.name.lower().endswith(TOKEN_SUFFIXES):
        ids = read_tokens(path, vocab_size)
        if ids.dim() == 2:
            return _given_rows(ids, rows, cols, where)
    else:
        if tokenizer is None:
            raise UserError(f"{path}: is text, and no tokenizer was given; pass the model's tokenizer or a token file")
        ids = encode_texts(tokenizer, read_texts(path), eos)
        check_ids(ids, vocab_size, f"{where} (tokenized)")
    return token_rows(ids, rows, cols, bos, where)


def _given_rows(ids: torch.Tensor, rows: int | None, cols: int, where: str) -> torch.Tensor:
    have, width = ids.shape
    if width != cols:
        raise UserError(f"{where}: rows are {width} tokens wide but {cols} were asked for; re-cut the file or ask for {width}")
    if rows is not None and not 1 <= rows <= have:
        raise UserError(f"{where}: holds {have} rows, {rows} were asked for; ask for at most {have}")
    return ids[: have if rows is None else rows]


def model_rows(
    root: str | os.PathLike,
    cfg,
    *,
    text: str | os.PathLike | None = None,
    tokens: str | os.PathLike | None = None,
    rows: int | None = None,
    cols: int | None = None,
    default_cols: int,
) -> torch.Tensor:
    """Rows for the model in `root` (config `cfg`): token ids as given (`tokens`: .npy or .safetensors;
    a 2-D file's width sets cols unless asked), else `text` tokenized with root/tokenizer.json, one BOS
    per row and EOS between documents."""
    if tokens is not None:
        if not str(tokens).lower().endswith(TOKEN_SUFFIXES):
            raise UserError(f"{tokens}: --tokens takes a .npy or .safetensors file; use --text for text")
        if cols is None:
            ids = read_tokens(tokens, cfg.vocab_size)
            cols = ids.shape[1] if ids.dim() == 2 else default_cols
        return rows_from_file(tokens, rows, cols, vocab_size=cfg.vocab_size)
    if text is None:
        raise ValueError("model_rows: give text or tokens")
    root = Path(root)
    if not (root / "tokenizer.json").exists():
        raise UserError(f"{root}: has no tokenizer.json to tokenize {text}; pass token ids (--tokens) instead")
    return rows_from_file(text, rows, cols or default_cols, tokenizer=load_tokenizer(root), bos=cfg.bos_token_id,
                          eos=cfg.eos_token_id, vocab_size=cfg.vocab_size)
