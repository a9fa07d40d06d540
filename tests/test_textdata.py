"""Text data: the shipped sets stay disjoint and match their provenance (heldout-tests holds only
CPython test-suite files, within the evaluation sets' rules), the tokenizer round-trips, `--text`
reads a shipped set by name, and every way a user's text or token file can be wrong ends in a
UserError naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import zstandard
from script_module import script_module

from quantizer.checkpoint.safetensors_file import planned, write_safetensors
from quantizer.errors import UserError
from quantizer.textdata import (
    SET_FILES,
    SPECIAL_TOKENS,
    default_text,
    default_tokenizer,
    encode_texts,
    load_tokenizer,
    read_texts,
    read_tokens,
    rows_from_file,
    shipped_text_path,
    text_argument,
    token_rows,
)

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "calibration"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def set_content(name: str) -> bytes:
    data = (CALIBRATION / SET_FILES[name]).read_bytes()
    return zstandard.ZstdDecompressor().stream_reader(data).read() if SET_FILES[name].endswith(".zst") else data


def sources(name: str) -> list[str]:
    return [json.loads(line)["source"] for line in set_content(name).decode("ascii").splitlines()]


@pytest.fixture(scope="module")
def rules():
    """calibration/build_corpus.py, whose constants are the split rules (it is a script, not a package module)."""
    with script_module(CALIBRATION / "build_corpus.py") as module:
        yield module


def is_test_suite_file(rules, source: str) -> bool:
    prefix = f"cpython-{rules.PYTHON_VERSION}:Lib/"
    return source.startswith(prefix) and source.endswith(".py") and bool(
        rules.TEST_DIRS.intersection(Path(source.removeprefix(prefix)).parts[:-1]))


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


# --- the shipped sets -------------------------------------------------------------------------


def test_sets_share_no_document_or_text():
    names = list(SET_FILES)
    by_source = {n: set(sources(n)) for n in names}
    by_text = {n: {sha256(t.encode("utf-8")) for t in default_text(n)} for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not by_source[a] & by_source[b], f"{a} and {b} share documents"
            assert not by_text[a] & by_text[b], f"{a} and {b} share texts"


@pytest.mark.parametrize("name, low, high", [("calibration", 100_000, 300_000), ("heldout", 100_000, 200_000)])
def test_evaluation_sets_mix_code_and_prose(name, low, high):
    ids = sources(name)
    code = [s for s in ids if s.endswith(".py")]
    assert code and len(code) < len(ids), f"{name} should hold both code and prose"
    assert any(s.startswith("https://en.wikipedia.org/") for s in ids)
    assert low <= sum(len(t.encode("utf-8")) for t in default_text(name)) <= high


def test_heldout_tests_is_test_suite_code_within_the_evaluation_rules(rules):
    docs = [json.loads(line) for line in set_content("heldout-tests").decode("ascii").splitlines()]
    assert docs and all(is_test_suite_file(rules, d["source"]) for d in docs)
    for name in ("train", "calibration", "heldout"):
        assert not any(is_test_suite_file(rules, s) for s in sources(name)), f"{name} holds a test-suite file"
    sizes = [len(d["text"].encode("utf-8")) for d in docs]
    assert all(rules.MIN_DOC_BYTES <= n <= rules.EVAL_DOC_MAX_BYTES for n in sizes)
    assert 0.9 * rules.TEST_SET_BUDGET <= sum(sizes) <= rules.TEST_SET_BUDGET
    assert len({d["text"] for d in docs}) == len(docs), "an exact duplicate is kept once"
    assert not any(rules.TEST_OWN_NOTICE.search(d["text"]) for d in docs), "a file with its own licence notice"
    keys = [rules.order_key(rules.Document(d["source"], "cpython-test-suites", "code", "")) for d in docs]
    assert keys == sorted(keys), "documents are in sha256(SALT + id) order"
    # Whole files: a document is the file as CPython ships it (where this Python is that CPython).
    root = Path(sysconfig.get_paths()["stdlib"])
    if sys.version_info[:3] == (3, 11, 7) and (root / "test").is_dir():
        for d in docs:
            assert (root / d["source"].partition(":Lib/")[2]).read_text("utf-8") == d["text"], d["source"]


def test_provenance_records_the_files_as_they_are():
    record = json.loads((CALIBRATION / "provenance.json").read_text())
    assert list(record["sets"]) == ["heldout", "calibration", "train", "heldout-tests"]
    assert set(record["sets"]) == set(SET_FILES)
    for name, rec in record["sets"].items():
        stored = (CALIBRATION / rec["file"]).read_bytes()
        assert rec["file_sha256"] == sha256(stored), name
        assert rec["content_sha256"] == sha256(set_content(name)), name
        assert rec["documents"] == len(sources(name)), name
    used = {n for n, f in record["exllamav3_wheel"]["calibration_files"].items() if f["used"]}
    assert used == {"wiki.utf8"}


@pytest.mark.skipif(
    sys.version_info[:3] != (3, 11, 7) or not Path(os.environ.get("EXLLAMAV3_WHEEL", "-")).is_file(),
    reason="the sets are rebuilt from CPython 3.11.7's standard library and the exllamav3 1.6.5 wheel ($EXLLAMAV3_WHEEL)",
)
def test_corpus_rebuilds_identically():
    done = subprocess.run([sys.executable, str(CALIBRATION / "build_corpus.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_unknown_set_name_is_a_user_error():
    with pytest.raises(UserError, match="shipped sets are train, calibration, heldout, heldout-tests$"):
        shipped_text_path("validation")


def test_text_argument_is_a_file_or_a_set_name(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # its calibration/ folder is no file, so the name still means the set
    assert text_argument("calibration") == shipped_text_path("calibration")
    assert text_argument("heldout-tests") == shipped_text_path("heldout-tests") == CALIBRATION / "heldout_tests.jsonl"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heldout").write_text("the user's own file\n")
    assert text_argument("heldout") == Path("heldout"), "a file of a set's name is read as given"
    with pytest.raises(UserError, match=r"^heldout-test: no such file, and not a shipped text set "
                       r"\(train, calibration, heldout, heldout-tests\); check the path or the set name$"):
        text_argument("heldout-test")


def test_the_wheel_ships_every_set_but_train():
    """pyproject's package data lists each evaluation set (train stays in the repository, PROVENANCE.md)."""
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    listed = shipped["quantizer.calibration"]
    assert [f for f in SET_FILES.values() if f in listed] == [f for n, f in SET_FILES.items() if n != "train"]


# --- the tokenizer ------------------------------------------------------------------------------


def test_tokenizer_has_the_configs_special_ids(tokenizer):
    assert tokenizer.get_vocab_size() == 4096
    assert {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} == SPECIAL_TOKENS
    config = json.loads((REPO / "configs/models/tiny-v41.json").read_text())
    ids = {"<|bos|>": config["bos_token_id"], "<|eos|>": config["eos_token_id"], "<|pad|>": config["pad_token_id"],
           "<|image|>": config["image_token_id"], "<|dspark_noise|>": config["text_config"]["dspark_noise_token_id"]}
    assert ids == SPECIAL_TOKENS


@pytest.mark.parametrize("name", ["heldout", "heldout-tests"])
def test_tokenizer_round_trips_heldout_and_compresses(tokenizer, name):
    texts = default_text(name)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    assert [tokenizer.decode(e.ids) for e in encodings] == texts
    per_byte = sum(len(e.ids) for e in encodings) / sum(len(t.encode("utf-8")) for t in texts)
    assert 0.2 < per_byte < 0.45


def test_tokenizer_was_trained_on_the_current_train_set():
    record = json.loads((CALIBRATION / "tokenizer_provenance.json").read_text())
    corpus = json.loads((CALIBRATION / "provenance.json").read_text())
    assert record["trained_on"]["content_sha256"] == corpus["sets"]["train"]["content_sha256"]
    assert record["tokenizer_sha256"] == sha256((CALIBRATION / "tokenizer.json").read_bytes())


def test_load_tokenizer_accepts_a_directory_and_rejects_bad_files(tmp_path):
    assert load_tokenizer(CALIBRATION).get_vocab_size() == 4096
    with pytest.raises(UserError, match="tokenizer not found"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(UserError, match=r"tokenizer.json: not a valid tokenizers"):
        load_tokenizer(bad)


# --- text files -----------------------------------------------------------------------------------


def test_read_texts_plain_jsonl_and_compressed(tmp_path):
    (tmp_path / "a.txt").write_text("one document\nwith two lines\n")
    assert read_texts(tmp_path / "a.txt") == ["one document\nwith two lines\n"]
    lines = [json.dumps({"text": "first\u2028still first"}), "", json.dumps({"text": "second", "id": 2})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_texts(tmp_path / "b.jsonl") == ["first\u2028still first", "second"]
    # Compressed by a stream, as the zstd CLI does from a pipe: the frame has no content size.
    for name, src in (("c.txt.zst", "a.txt"), ("d.jsonl.zst", "b.jsonl")):
        with open(tmp_path / name, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
            w.write((tmp_path / src).read_bytes())
        assert read_texts(tmp_path / name) == read_texts(tmp_path / src)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"text": "ok"}\n{"text": "broken\n', r"bad.jsonl: line 2 is not valid JSON"),
        ("bad.jsonl", b'{"text": "ok"}\n\n{"body": "no text"}\n', r'bad.jsonl: line 3 has no "text" string field'),
        ("bad.jsonl", b'["a list"]\n', r'line 1 has no "text"'),
        ("bad.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n', r"bad.jsonl: line 2: not UTF-8"),
        ("bad.txt", b"caf\xe9", r"bad.txt: not UTF-8 \(bad byte at offset 3\)"),
        ("empty.txt", b"", r"empty.txt: holds no text"),
        ("blank.jsonl", b"\n\n", r"blank.jsonl: holds no text"),
        ("bad.txt.zst", b"not zstd at all", r"bad.txt.zst: not a valid zstandard file"),
    ],
)
def test_read_texts_rejects_bad_files(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=message):
        read_texts(tmp_path / name)


def test_read_texts_missing_directory_and_token_file(tmp_path):
    with pytest.raises(UserError, match="nope.txt: file not found"):
        read_texts(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="is a directory"):
        read_texts(tmp_path)
    with pytest.raises(UserError, match="is a token file, not text"):
        read_texts(tmp_path / "ids.npy")


# --- token files ----------------------------------------------------------------------------------


def test_read_tokens_npy_and_safetensors(tmp_path):
    np.save(tmp_path / "s.npy", np.array([5, 6, 7], dtype=np.int32))
    stream = read_tokens(tmp_path / "s.npy", vocab_size=8)
    assert stream.dtype == torch.int64 and stream.tolist() == [5, 6, 7]
    rows = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    write_safetensors(tmp_path / "r.safetensors", [planned("input_ids", rows)])
    assert torch.equal(read_tokens(tmp_path / "r.safetensors"), rows.long())


def _npy(path, array):
    np.save(path, array, allow_pickle=True)


@pytest.mark.parametrize(
    "name, make, vocab, message",
    [
        ("f.npy", lambda p: _npy(p, np.zeros(4, np.float32)), None, r"f.npy: token ids have dtype float32"),
        ("o.npy", lambda p: _npy(p, np.array([1, "x"], dtype=object)), None, r"o.npy: not a readable .npy array"),
        ("t.npy", lambda p: p.write_bytes(b"\x93NUMPY garbage"), None, r"t.npy: not a readable .npy array"),
        ("e.npy", lambda p: _npy(p, np.zeros(0, np.int64)), None, r"e.npy: token ids have shape \[0\]"),
        ("c.npy", lambda p: _npy(p, np.zeros((2, 2, 2), np.int64)), None, r"shape \[2, 2, 2\]"),
        ("n.npy", lambda p: _npy(p, np.array([3, -1])), None, r"n.npy: negative token id -1"),
        ("v.npy", lambda p: _npy(p, np.array([3, 4096, 5000])), 4096, r"v.npy: token id 5000 is outside .* 4096 \(2 ids"),
        ("k.safetensors", lambda p: write_safetensors(p, [planned("tokens", torch.zeros(3, dtype=torch.int64))]),
         None, r"k.safetensors: no 'input_ids' tensor \(found: tokens\)"),
        ("d.safetensors", lambda p: write_safetensors(p, [planned("input_ids", torch.zeros(3))]),
         None, r"d.safetensors: 'input_ids' has dtype F32"),
        ("x.safetensors", lambda p: p.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{}"), None, r"x.safetensors: header claims"),
        ("ids.bin", lambda p: p.write_bytes(b"1234"), None, r"ids.bin: token files must be .npy or .safetensors"),
    ],
)
def test_read_tokens_rejects_bad_files(tmp_path, name, make, vocab, message):
    make(tmp_path / name)
    with pytest.raises(UserError, match=message):
        read_tokens(tmp_path / name, vocab_size=vocab)


def test_read_tokens_missing_file(tmp_path):
    for name in ("gone.npy", "gone.safetensors"):
        with pytest.raises(UserError, match=f"{name}: .*(not found|missing)"):
            read_tokens(tmp_path / name)


# --- rows -----------------------------------------------------------------------------------------


def test_token_rows_cut_a_stream_from_its_start():
    ids = torch.arange(10, 20)
    assert token_rows(ids, 2, 4).tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert token_rows(ids, 2, 4, bos=0).tolist() == [[0, 10, 11, 12], [0, 13, 14, 15]]
    assert token_rows(ids, None, 3, bos=0).tolist() == [[0, 10, 11], [0, 12, 13], [0, 14, 15], [0, 16, 17], [0, 18, 19]]


def test_token_rows_errors_name_what_is_needed():
    with pytest.raises(UserError, match=r"10 tokens, but 4 rows of 4 need 12"):
        token_rows(torch.arange(10), 4, 4, bos=0)
    with pytest.raises(UserError, match=r"2 tokens, but 1 rows of 4 need 4"):
        token_rows(torch.arange(2), None, 4)
    with pytest.raises(UserError, match="no room for text"):
        token_rows(torch.arange(10), 1, 1, bos=0)
    with pytest.raises(UserError, match="at least one"):
        token_rows(torch.arange(10), 0, 2)
    with pytest.raises(UserError, match="expected a 1-D token stream"):
        token_rows(torch.zeros(2, 5, dtype=torch.int64), 1, 2)


def test_rows_from_text_add_bos_and_separate_documents_with_eos(tmp_path, tokenizer):
    docs = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog."]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = encode_texts(tokenizer, docs, eos=1)
    cols = 8
    rows = rows_from_file(tmp_path / "t.jsonl", None, cols, tokenizer=tokenizer, bos=0, eos=1, vocab_size=4096)
    assert rows.shape == (stream.numel() // (cols - 1), cols)
    assert (rows[:, 0] == 0).all() and torch.equal(rows[:, 1:].flatten(), stream[: rows.shape[0] * (cols - 1)])
    assert int((stream == 1).sum()) == 2 and int(stream[-1]) == 1
    with pytest.raises(UserError, match=r"t.jsonl \(tokenized\): token id \d+ is outside the model's vocabulary of 300"):
        rows_from_file(tmp_path / "t.jsonl", 1, cols, tokenizer=tokenizer, vocab_size=300)
    with pytest.raises(UserError, match="t.jsonl: is text, and no tokenizer was given"):
        rows_from_file(tmp_path / "t.jsonl", 1, cols)


def test_rows_from_token_files(tmp_path):
    np.save(tmp_path / "rows.npy", np.arange(12).reshape(3, 4))
    assert rows_from_file(tmp_path / "rows.npy", 2, 4, bos=0).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows_from_file(tmp_path / "rows.npy", None, 4).shape == (3, 4)
    with pytest.raises(UserError, match=r"rows.npy: rows are 4 tokens wide but 8 were asked for"):
        rows_from_file(tmp_path / "rows.npy", 1, 8)
    with pytest.raises(UserError, match=r"rows.npy: holds 3 rows, 5 were asked for"):
        rows_from_file(tmp_path / "rows.npy", 5, 4)
    np.save(tmp_path / "stream.npy", np.arange(3, 12))
    assert rows_from_file(tmp_path / "stream.npy", 2, 4, bos=0).tolist() == [[0, 3, 4, 5], [0, 6, 7, 8]]
    with pytest.raises(UserError, match=r"stream.npy: 9 tokens, but 5 rows of 4 need 15"):
        rows_from_file(tmp_path / "stream.npy", 5, 4, bos=0)
