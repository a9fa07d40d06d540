"""Loading a `tokenizers` tokenizer and turning documents into one token stream."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from quantizer.errors import UserError

# The small bundled V4.1 model's special tokens, at the ids its config names: bos/eos/pad as in
# V4.1 (0, 1, 2), and the DSpark noise and image tokens at the top of the vocabulary (tiny-v41.json).
SPECIAL_TOKENS = {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "<|dspark_noise|>": 4094, "<|image|>": 4095}

_ENCODE_CHUNK = 256  # documents per encode_batch call, so progress moves on large sets


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tokenizer.json`, given as the file or the directory that holds it."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file}: tokenizer not found; pass a tokenizer.json or the model directory that holds one")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
        raise UserError(f"{file}: not a valid tokenizers tokenizer.json ({str(e).splitlines()[0]})") from None


def encode_texts(tokenizer: Tokenizer, texts: list[str], eos: int | None = None) -> torch.Tensor:
    """All documents as one int64 stream, each followed by `eos` when given (so rows cut from the
    stream see document ends as the model was trained to). No special tokens are added otherwise."""
    parts = []
    with tqdm(total=len(texts), unit="doc", desc="tokenizing", disable=len(texts) <= _ENCODE_CHUNK) as bar:
        for start in range(0, len(texts), _ENCODE_CHUNK):
            for encoding in tokenizer.encode_batch(texts[start : start + _ENCODE_CHUNK], add_special_tokens=False):
                parts.append(np.asarray(encoding.ids, dtype=np.int64))
                if eos is not None:
                    parts.append(np.array([eos], dtype=np.int64))
            bar.update(min(_ENCODE_CHUNK, len(texts) - start))
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int64)
