"""Reading user inputs: text documents (plain, JSONL, either zstandard-compressed) and token files.

Every problem is a UserError naming the file (and the line, for JSONL) and what to do about it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from quantizer.checkpoint.safetensors_file import read_header, read_tensor
from quantizer.errors import UserError

TOKEN_SUFFIXES = (".npy", ".safetensors")
TOKENS_KEY = "input_ids"
_INTEGER_DTYPES = {"U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}


def _read_bytes(path: Path) -> bytes:
    if path.is_dir():
        raise UserError(f"{path}: is a directory; pass a text, JSONL or token file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; check the path") from None
    if path.name.lower().endswith(".zst"):
        try:  # optional (pyproject's `zstd` extra): only compressed inputs need it
            import zstandard
        except ImportError:
            raise UserError(f"{path}: reading .zst files needs the zstandard package: pip install 'quantizer[zstd]', "
                            "or decompress it first with `zstd -d`") from None
        try:
            # A stream reader also handles frames written without a content size (zstd CLI from a pipe).
            data = zstandard.ZstdDecompressor().stream_reader(data).read()
        except zstandard.ZstdError as e:
            raise UserError(f"{path}: not a valid zstandard file ({e}); recompress it with `zstd`") from None
    return data


def read_texts(path: str | os.PathLike) -> list[str]:
    """The documents in a text file: one per line of a `.jsonl` file (its "text" field), or the
    whole file for plain text. A `.zst` suffix on either means zstandard-compressed."""
    path = Path(path)
    name = path.name.lower().removesuffix(".zst")
    if name.endswith(TOKEN_SUFFIXES):
        raise UserError(f"{path}: is a token file, not text; pass it where tokens are accepted")
    data = _read_bytes(path)
    texts = _jsonl_texts(path, data) if name.endswith(".jsonl") else [_decode(path, data, "utf-8-sig")]
    if not any(texts):
        raise UserError(f"{path}: holds no text; pass a file with at least one non-empty document")
    return texts


def _decode(path: Path, data: bytes, encoding: str, where: str = "") -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}{where}: not UTF-8 (bad byte at offset {e.start}); convert the file to UTF-8") from None


def _jsonl_texts(path: Path, data: bytes) -> list[str]:
    texts = []
    # Split on "\n" only: str.splitlines would also break inside a raw U+2028 in a JSON string.
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line = _decode(path, raw, "utf-8-sig" if number == 1 else "utf-8", f": line {number}")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f'{path}: line {number} has no "text" string field; each line must be {{"text": "..."}}')
        texts.append(record["text"])
    return texts


def read_tokens(path: str | os.PathLike, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids from a `.npy` array or the `input_ids` tensor of a `.safetensors` file, as int64,
    1-D (a stream) or 2-D (rows). With `vocab_size`, ids outside [0, vocab_size) are an error."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        ids = _npy_tokens(path)
    elif suffix == ".safetensors":
        ids = _safetensors_tokens(path)
    else:
        raise UserError(f"{path}: token files must be .npy or .safetensors (key {TOKENS_KEY!r})")
    if ids.dim() not in (1, 2) or ids.numel() == 0:
        raise UserError(f"{path}: token ids have shape {list(ids.shape)}; expected a non-empty 1-D stream or 2-D rows")
    check_ids(ids, vocab_size, str(path))
    return ids


def check_ids(ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    """Token ids must be non-negative and, when the model's vocabulary size is known, below it."""
    if ids.numel() and int(ids.min()) < 0:
        raise UserError(f"{where}: negative token id {int(ids.min())}; token ids start at 0")
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        over = int((ids >= vocab_size).sum())
        raise UserError(
            f"{where}: token id {int(ids.max())} is outside the model's vocabulary of {vocab_size} "
            f"({over} ids out of range); tokenize with the model's own tokenizer"
        )


def _npy_tokens(path: Path) -> torch.Tensor:
    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; check the path") from None
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path}: not a readable .npy array ({e}); save it with numpy.save") from None
    if array.dtype.kind not in "iu":
        raise UserError(f"{path}: token ids have dtype {array.dtype}; save them as an integer array")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise UserError(f"{path}: token id {array.max()} is too large for a token id")
    return torch.from_numpy(array.astype(np.int64))


def _safetensors_tokens(path: Path) -> torch.Tensor:
    tensors = read_header(path).tensors
    if TOKENS_KEY not in tensors:
        found = ", ".join(sorted(tensors)) or "none"
        raise UserError(f"{path}: no {TOKENS_KEY!r} tensor (found: {found}); save the token ids under that key")
    entry = tensors[TOKENS_KEY]
    if entry.dtype not in _INTEGER_DTYPES:
        raise UserError(f"{path}: {TOKENS_KEY!r} has dtype {entry.dtype}; save the token ids as integers")
    return read_tensor(entry).to(torch.int64)
