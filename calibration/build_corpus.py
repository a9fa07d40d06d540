"""Build the shipped text sets (train, calibration, heldout, heldout-tests) from clearly licensed offline sources.

Why a script: the sets must be rebuildable byte for byte and their provenance checkable, so the
small model's training text can be shown never to overlap the text its packs are judged on.

Sources:
  - the CPython 3.11.7 standard library (PSF License Version 2): its .py modules are code documents,
    and the reference-manual topics in pydoc_data/topics.py are prose documents;
  - the English Wikipedia articles in exllamav3 1.6.5's conversion/standard_cal_data/wiki.utf8
    (CC BY-SA; each article names its URL). The wheel's other calibration files do not say where
    their text comes from, so they are recorded and left out;
  - CPython 3.11.7's own test suites (PSF License Version 2), for the heldout-tests set only.

Split rule: the unit is the document (one .py file, one pydoc topic, one Wikipedia article);
documents under MIN_DOC_BYTES (title-only Wikipedia stubs, empty __init__.py) are dropped and exact
duplicate texts are kept once. Documents are ordered by sha256(SALT + document id). Walking that
order, a document goes whole to `heldout` if it fits the heldout budget left for its kind (code or
prose), else to `calibration` if it fits that budget, else to `train`. Only documents of at most
EVAL_DOC_MAX_BYTES can enter the two evaluation sets. No document is in two sets.

A fourth set, `heldout-tests`, is held-out text of another kind than the calibration text: the .py
files of CPython's own test suites (Lib/test/, Lib/*/tests/, idlelib/idle_test/), which the three
sets above leave out. Same rules where they apply: whole documents, UTF-8 only, MIN_DOC_BYTES to
EVAL_DOC_MAX_BYTES, exact duplicates (also of any document of the other sets) dropped, files with
their own licence notice left out; walking the same sha256 order, a file goes in while it fits
TEST_SET_BUDGET.

Run from the repository root with the venv's Python 3.11.7:
    python calibration/build_corpus.py            # writes the sets and provenance.json
    python calibration/build_corpus.py --check    # rebuilds in memory, compares with provenance.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import zstandard

from quantizer.textdata.shipped_sets import SET_FILES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PYTHON_VERSION = "3.11.7"
STDLIB = "Lib/ of the CPython installation that runs the script (sysconfig's stdlib path)"  # no machine path in the record
WHEEL_ENV = "EXLLAMAV3_WHEEL"  # the exllamav3 1.6.5 wheel (PyPI: exllamav3-1.6.5-py3-none-any.whl)
CAL_DATA = "exllamav3/conversion/standard_cal_data/"

SALT = "quantizer-corpus-v1"
EVAL_DOC_MAX_BYTES = 16_384
MIN_DOC_BYTES = 128
# Bytes of document text per set and kind; what is left over goes to train.
BUDGETS = {
    "heldout": {"code": 80_000, "prose": 80_000},
    "calibration": {"code": 120_000, "prose": 120_000},
}
ZSTD_LEVEL = 19
TEST_SET = "heldout-tests"
TEST_SET_BUDGET = 80_000  # bytes of test-suite code

# Not read as code: third-party packages, and pydoc_data (its topics are read as prose documents).
NOT_LIB = {"site-packages", "pydoc_data"}
# Standard-library files left out, each with its reason in provenance.json (see stdlib_exclusion).
TEST_DIRS = {"test", "tests", "idle_test"}
OWN_NOTICE = re.compile(r"Permission (is hereby granted|to use, copy)|Apache License")
# OWN_NOTICE stays as it was so the first three sets rebuild byte for byte; the test set also spots the
# zlib-style notice ("Permission is granted to anyone"), SPDX tags and notices with irregular spacing.
TEST_OWN_NOTICE = re.compile(r"Permission\s+(is\s+(hereby\s+)?granted|to\s+use,\s+copy)|Apache License|SPDX-License-Identifier")
GENERATED_CODEC = "Character Mapping Codec"  # with a decoding table: encodings/cp*.py and friends

# What each calibration file in the exllamav3 wheel says about its origin, and whether we use it.
EXLLAMAV3_FILES = {
    "wiki.utf8": {
        "used": True,
        "says": "Each article starts with a WikiExtractor header <doc id url title> naming an "
        "English Wikipedia article (https://en.wikipedia.org/wiki?curid=N).",
        "licence": "CC BY-SA (Wikipedia text: 3.0 before 2023-06-29, 4.0 since) and GFDL; "
        "attribution is the article URL kept as each document's source; the dump date is not stated",
    },
    "c4.utf8": {
        "used": False,
        "says": "Nothing; one web page per line (forum and shop pages); the name suggests the C4 "
        "Common Crawl extract.",
        "licence": "unclear: third-party web pages with no attribution",
    },
    "code.utf8": {
        "used": False,
        "says": "Nothing; assorted snippets (assembly, C, Python, Rust, TypeScript, HTML, licence headers).",
        "licence": "unclear: origin of each snippet unknown",
    },
    "multilingual.utf8": {
        "used": False,
        "says": "Nothing; English summaries and passages in Chinese, Japanese, Greek, German, "
        "Italian, French, Dutch, Spanish, Turkish, some encyclopedia-like, none attributed.",
        "licence": "unclear: no origin stated",
    },
    "technical.utf8": {
        "used": False,
        "says": "Nothing; starts with an MIT licence text, then encyclopedia-like and finance "
        "passages, none attributed.",
        "licence": "unclear: no origin stated",
    },
    "tiny.utf8": {
        "used": False,
        "says": "Nothing; short children's stories separated by <|endoftext|>, in the style of the "
        "TinyStories data set (whose card gives CDLA-Sharing-1.0), but the file does not say so.",
        "licence": "unclear: origin inferred, not stated",
    },
}


@dataclass(frozen=True)
class Document:
    """One unit of the split: it goes whole to exactly one set."""

    id: str
    source: str  # key into the sources table of provenance.json
    kind: str  # "code" or "prose"
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stdlib_root() -> Path:
    found = ".".join(map(str, sys.version_info[:3]))
    if found != PYTHON_VERSION:
        sys.exit(f"build_corpus.py: run it with Python {PYTHON_VERSION} (this is {found}): "
                 "the recorded sets come from that version's standard library")
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_exclusion(rel: Path, text: str) -> str | None:
    """Why a standard-library .py file is left out, or None to use it."""
    if rel.name.startswith("_sysconfigdata"):
        return "generated at build time with machine paths"
    if TEST_DIRS.intersection(rel.parts[:-1]):
        return "test suite"
    if GENERATED_CODEC in text[:200] and ("decoding_table = (" in text or "decoding_map = " in text):
        return "generated codec table"
    if OWN_NOTICE.search(text):
        return "carries its own licence notice besides the PSF licence"
    return None


def stdlib_documents(root: Path) -> tuple[list[Document], list[Document], dict[str, list[str] | int]]:
    """The library's code documents, its test-suite files (for heldout-tests), and what was left out of the library, by reason."""
    docs, tests, excluded = [], [], {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_LIB or rel.parts[0].startswith("config-"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            excluded.setdefault("not UTF-8", []).append(rel.as_posix())
            continue
        reason = stdlib_exclusion(rel, text)
        doc_id = f"cpython-{PYTHON_VERSION}:Lib/{rel.as_posix()}"
        if reason == "test suite":
            tests.append(Document(doc_id, "cpython-test-suites", "code", text))
        if reason:
            excluded.setdefault(reason, []).append(rel.as_posix())
            continue
        docs.append(Document(doc_id, "cpython-stdlib", "code", text))
    # Long lists (tests, codec tables) are summarised by count; short ones name every file.
    summary = {reason: (paths if len(paths) <= 40 else len(paths)) for reason, paths in excluded.items()}
    return docs, tests, summary


def topic_documents(root: Path) -> list[Document]:
    """The reference-manual topics that `help()` shows: prose generated from the Python docs."""
    tree = ast.parse((root / "pydoc_data" / "topics.py").read_text("utf-8"))
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "topics"]
    topics = ast.literal_eval(assign.value)
    return [
        Document(f"cpython-{PYTHON_VERSION}:Lib/pydoc_data/topics.py#{name}", "cpython-doc-topics", "prose", text)
        for name, text in sorted(topics.items())
    ]


WIKI_DOC = re.compile(r'<doc id="(\d+)" url="([^"]+)" title="[^"]*">\n(.*?)\n</doc>\n?', re.S)


def wiki_documents(raw: str) -> list[Document]:
    docs = [Document(url, "wikipedia-via-exllamav3", "prose", body) for _, url, body in WIKI_DOC.findall(raw)]
    if len(docs) != raw.count("<doc "):
        sys.exit("build_corpus.py: wiki.utf8 has <doc> entries that do not parse; check its format")
    return docs


def read_exllamav3(wheel: Path | None) -> tuple[dict[str, bytes], str]:
    if wheel is None or not wheel.is_file():
        sys.exit(f"build_corpus.py: exllamav3 wheel {wheel or '(none given)'} not found; pass --exllamav3-wheel "
                 f"or set ${WHEEL_ENV}")
    with zipfile.ZipFile(wheel) as zf:
        files = {name: zf.read(CAL_DATA + name) for name in sorted(EXLLAMAV3_FILES)}
    return files, sha256(wheel.read_bytes())


def order_key(doc: Document) -> str:
    """The order in which documents are offered to the sets: a salted hash of the id, not of the text."""
    return sha256(f"{SALT}\0{doc.id}".encode("utf-8"))


def keep_once(docs: list[Document], dropped: dict, seen: set[str] = frozenset(),
              too_long: int | None = None) -> list[Document]:
    """`docs` in id order less those under MIN_DOC_BYTES, over `too_long` bytes, or whose exact text came
    before (or is in `seen`, sha256 of texts kept elsewhere); each left out is counted in `dropped`."""
    seen, kept = set(seen), []
    for doc in sorted(docs, key=lambda d: d.id):
        digest = sha256(doc.text.encode("utf-8"))
        if doc.nbytes < MIN_DOC_BYTES:
            dropped["shorter_than_min_doc_bytes"] += 1
        elif too_long is not None and doc.nbytes > too_long:
            dropped["longer_than_eval_doc_max_bytes"] += 1
        elif digest in seen:
            dropped["exact_duplicate"] += 1
        else:
            seen.add(digest)
            kept.append(doc)
    return kept


def split(docs: list[Document]) -> tuple[dict[str, list[Document]], dict[str, int]]:
    """Apply the split rule (module docstring). Returns the sets and how many documents were dropped, by reason."""
    dropped = {"shorter_than_min_doc_bytes": 0, "exact_duplicate": 0}
    unique = keep_once(docs, dropped)
    left = {name: dict(budget) for name, budget in BUDGETS.items()}
    sets = {"heldout": [], "calibration": [], "train": []}
    for doc in sorted(unique, key=order_key):
        target = "train"
        if doc.nbytes <= EVAL_DOC_MAX_BYTES:
            for name in ("heldout", "calibration"):
                if left[name][doc.kind] >= doc.nbytes:
                    target = name
                    left[name][doc.kind] -= doc.nbytes
                    break
        sets[target].append(doc)
    return sets, dropped


def heldout_tests_set(tests: list[Document], other_texts: set[str]) -> tuple[list[Document], dict]:
    """The heldout-tests set (module docstring) from the test-suite files; `other_texts` are the sha256
    of every text of the other sets' sources. Returns the set and what was left out, by reason."""
    notices = sorted(d.id for d in tests if TEST_OWN_NOTICE.search(d.text))
    left_out = {"own_licence_notice": [i.partition(":Lib/")[2] for i in notices], "shorter_than_min_doc_bytes": 0,
                "longer_than_eval_doc_max_bytes": 0, "exact_duplicate": 0}
    candidates = keep_once([d for d in tests if d.id not in notices], left_out, other_texts,
                           too_long=EVAL_DOC_MAX_BYTES)
    chosen, left = [], TEST_SET_BUDGET
    for doc in sorted(candidates, key=order_key):
        if doc.nbytes <= left:
            chosen.append(doc)
            left -= doc.nbytes
    left_out["over_budget"] = len(candidates) - len(chosen)
    return chosen, left_out


def jsonl(docs: list[Document]) -> bytes:
    # ensure_ascii keeps U+2028 and friends escaped, so any line reader splits documents correctly.
    return "".join(json.dumps({"source": d.id, "text": d.text}) + "\n" for d in docs).encode("ascii")


def set_record(name: str, docs: list[Document], content: bytes) -> dict:
    by = {}
    for d in docs:
        entry = by.setdefault(d.source, {"documents": 0, "text_bytes": 0})
        entry["documents"] += 1
        entry["text_bytes"] += d.nbytes
    kinds = {k: sum(d.nbytes for d in docs if d.kind == k) for k in ("code", "prose")}
    return {
        "file": SET_FILES[name],
        "format": "JSONL, one document per line: {\"source\": id, \"text\": text}"
        + (f"; zstandard level {ZSTD_LEVEL}" if SET_FILES[name].endswith(".zst") else ""),
        "documents": len(docs),
        "text_bytes": sum(kinds.values()),
        "text_bytes_by_kind": kinds,
        "by_source": by,
        "content_bytes": len(content),
        "content_sha256": sha256(content),
    }


def build(wheel: Path) -> tuple[dict[str, bytes], dict]:
    """Each set's uncompressed JSONL, and the provenance record (without the stored files' hashes)."""
    root = stdlib_root()
    licence = (root / "LICENSE.txt").read_bytes()
    code, tests, stdlib_excluded = stdlib_documents(root)
    topics = topic_documents(root)
    cal_files, wheel_sha = read_exllamav3(wheel)
    wiki = wiki_documents(cal_files["wiki.utf8"].decode("utf-8"))
    sets, dropped = split(code + topics + wiki)
    sets[TEST_SET], tests_left_out = heldout_tests_set(tests, {sha256(d.text.encode("utf-8")) for d in code + topics + wiki})
    contents = {name: jsonl(docs) for name, docs in sets.items()}
    provenance = {
        "generator": "calibration/build_corpus.py",
        "python": PYTHON_VERSION,
        "zstandard": f"{zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})",
        "split_rule": {
            "unit": "document: one standard-library .py file, one pydoc topic, one Wikipedia article",
            "order": f"sha256('{SALT}' + NUL + document id), ascending",
            "assignment": "heldout if it fits heldout's budget left for its kind, else calibration "
            "if it fits, else train; only documents of at most eval_doc_max_bytes enter heldout or calibration",
            "budgets_text_bytes": BUDGETS,
            "eval_doc_max_bytes": EVAL_DOC_MAX_BYTES,
            "min_doc_bytes": MIN_DOC_BYTES,
            "documents_dropped": dropped,
            TEST_SET: {
                "unit": "document: one .py file of CPython's test suites (the library's files left out as 'test suite')",
                "assignment": f"in the same order, a file goes in while it fits the budget of {TEST_SET_BUDGET} "
                "text bytes; only UTF-8 files of min_doc_bytes to eval_doc_max_bytes without their own licence "
                "notice, and no text that another set holds",
                "budget_text_bytes": TEST_SET_BUDGET,
                "left_out": tests_left_out,
            },
        },
        "sources": {
            "cpython-stdlib": {
                "kind": "code",
                "what": f"CPython {PYTHON_VERSION} standard library .py modules (Lib/)",
                "path": STDLIB,
                "licence": "PSF License Version 2 (LICENSE.txt of the same installation)",
                "licence_file_sha256": sha256(licence),
                "documents": len(code),
                "excluded": stdlib_excluded,
            },
            "cpython-test-suites": {
                "kind": "code",
                "what": f"CPython {PYTHON_VERSION} test suites: .py files under Lib/test/, Lib/*/tests/ and "
                "idlelib/idle_test/ (UTF-8 ones)",
                "path": STDLIB,
                "licence": "PSF License Version 2 (LICENSE.txt of the same installation)",
                "documents": len(tests),
            },
            "cpython-doc-topics": {
                "kind": "prose",
                "what": "reference-manual topics in Lib/pydoc_data/topics.py (generated from the Python documentation)",
                "path": f"{STDLIB}/pydoc_data/topics.py",
                "licence": "PSF License Version 2 (Python documentation); code in it also Zero-Clause BSD",
                "file_sha256": sha256((root / "pydoc_data" / "topics.py").read_bytes()),
                "documents": len(topics),
            },
            "wikipedia-via-exllamav3": {
                "kind": "prose",
                "what": "English Wikipedia articles in exllamav3 1.6.5 " + CAL_DATA + "wiki.utf8",
                "licence": EXLLAMAV3_FILES["wiki.utf8"]["licence"],
                "documents": len(wiki),
            },
        },
        "exllamav3_wheel": {
            "file": wheel.name,
            "sha256": wheel_sha,
            "licence": "MIT (exllamav3's code); the texts keep their own origins, below",
            "calibration_files": {
                name: {**info, "bytes": len(cal_files[name]), "sha256": sha256(cal_files[name])}
                for name, info in EXLLAMAV3_FILES.items()
            },
        },
        "sets": {name: set_record(name, docs, contents[name]) for name, docs in sets.items()},
    }
    return contents, provenance


def stored_bytes(name: str, content: bytes) -> bytes:
    if SET_FILES[name].endswith(".zst"):
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(content)
    return content


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write(contents: dict[str, bytes], provenance: dict, out: Path) -> None:
    """Write each set (compressed where its name says so), then provenance.json with the files' hashes."""
    for name, content in contents.items():
        stored = stored_bytes(name, content)
        provenance["sets"][name].update(file_bytes=len(stored), file_sha256=sha256(stored))
        write_atomic(out / SET_FILES[name], stored)
    write_atomic(out / "provenance.json", (json.dumps(provenance, indent=1) + "\n").encode("utf-8"))


def check(provenance: dict, out: Path) -> int:
    """Compare a fresh build with the recorded one: the text each set holds, not its compression."""
    recorded = json.loads((out / "provenance.json").read_text("utf-8"))["sets"]
    bad = [n for n, rec in provenance["sets"].items() if rec["content_sha256"] != recorded.get(n, {}).get("content_sha256")]
    for name in bad:
        print(f"{name}: rebuilt content differs from provenance.json")
    print("corpus check:", "FAILED" if bad else "rebuilt sets match provenance.json")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exllamav3-wheel", type=Path, default=os.environ.get(WHEEL_ENV),
                        help=f"the exllamav3 1.6.5 wheel (default: ${WHEEL_ENV})")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--check", action="store_true", help="rebuild in memory and compare with provenance.json")
    args = parser.parse_args()
    contents, provenance = build(args.exllamav3_wheel)
    if args.check:
        return check(provenance, args.out)
    write(contents, provenance, args.out)
    for name, rec in provenance["sets"].items():
        print(f"{name:13s} {rec['documents']:5d} docs  text {rec['text_bytes']:>10,d} B  "
              f"{rec['file']} {rec['file_bytes']:>10,d} B  {rec['text_bytes_by_kind']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
