"""Train the small V4.1 model's byte-level BPE tokenizer on the shipped train set only.

Why 4,096 tokens: the embedding and the head stay BF16 passthrough in every pack and count against
the ~20 MB bundle, at vocab x hidden x 2 bytes each (4 MiB for both at hidden 256; 16k tokens would
take 16 MiB), and the ~11 MB train set gives a large vocabulary too few examples of its rare tokens.
Ids: <|bos|> 0, <|eos|> 1, <|pad|> 2 (the V4.1 config's bos/eos/pad), then the 256 byte tokens and the
merges, then <|dspark_noise|> 4094 and <|image|> 4095 (tiny-v41.json puts those two at the top).
Digits are split one by one, so numbers do not spend vocabulary.

Run from the repository root (a few seconds on 2 cores; the output is the same on every run):
    python training/tokenizer.py
It writes calibration/tokenizer.json and calibration/tokenizer_provenance.json (settings, the train
set's hash, tokens per byte on the evaluation sets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from quantizer.textdata import SPECIAL_TOKENS, default_text, encode_texts, shipped_text_path

REPO = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 4096
MIN_FREQUENCY = 2


def special_names(low: bool) -> list[str]:
    """Special tokens below (trained first) or above (added after) the learned vocabulary, in id order."""
    return [t for t, i in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]) if (i < 256) == low]


def train(texts: list[str]) -> Tokenizer:
    top = special_names(low=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(top),
        min_frequency=MIN_FREQUENCY,
        special_tokens=special_names(low=True),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.add_special_tokens(top)
    wrong = {t: tok.token_to_id(t) for t, i in SPECIAL_TOKENS.items() if tok.token_to_id(t) != i}
    if wrong or tok.get_vocab_size() != VOCAB_SIZE:
        sys.exit(f"tokenizer.py: special token ids {wrong} or vocab size {tok.get_vocab_size()} "
                 f"differ from {SPECIAL_TOKENS} / {VOCAB_SIZE}; the train set gave too few merges")
    return tok


def tokens_per_byte(tok: Tokenizer, texts: list[str]) -> float:
    return encode_texts(tok, texts).numel() / sum(len(t.encode("utf-8")) for t in texts)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "calibration", help="folder for tokenizer.json")
    args = parser.parse_args()
    tok = train(default_text("train"))
    for name in ("heldout", "calibration"):
        texts = default_text(name)
        if any(tok.decode(e.ids) != t for e, t in zip(tok.encode_batch(texts, add_special_tokens=False), texts)):
            sys.exit(f"tokenizer.py: decoding the {name} set does not give back its text")
    serialised = tok.to_str(pretty=True)
    corpus = json.loads((shipped_text_path("train").parent / "provenance.json").read_text("utf-8"))
    record = {
        "generator": "training/tokenizer.py",
        "tokenizers": tokenizers.__version__,
        "model": "byte-level BPE",
        "vocab_size": VOCAB_SIZE,
        "min_frequency": MIN_FREQUENCY,
        "pre_tokenizer": "individual digits, then GPT-2 byte-level regex split (no prefix space)",
        "special_tokens": SPECIAL_TOKENS,
        "trained_on": {"set": "train", "content_sha256": corpus["sets"]["train"]["content_sha256"]},
        "tokenizer_sha256": hashlib.sha256(serialised.encode("utf-8")).hexdigest(),
        "tokens_per_byte": {n: round(tokens_per_byte(tok, default_text(n)), 4) for n in ("heldout", "calibration")},
        "decodes_exactly": ["heldout", "calibration"],
    }
    write_atomic(args.out / "tokenizer.json", serialised)
    write_atomic(args.out / "tokenizer_provenance.json", json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
