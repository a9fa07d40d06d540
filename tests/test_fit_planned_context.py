"""`fit PACK` and the card fit a pack at what it was planned for (issue 61): a pack built with --sparks records its
Spark count, context and streams in its manifest (a one-Spark pack also its context in launch.env's CTX), and is
fitted there by default, with the verdict at the model's full context beside it; an explicit flag wins; a pack
without the record is fitted at the full context and says so in one line."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from quantizer.checkpoint.fingerprint import sha256_file
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXLLAMAV3_V41
from quantizer.fit.hardware import load_hardware
from quantizer.fit.launch import LAUNCH_FILE, read_launch
from quantizer.fit.memory import Scenario, evaluate
from quantizer.fit.stored import stored_from_pack
from quantizer.pack.card import CARD_NAME, render_card
from quantizer.pack.fit_table import pack_fit_table
from quantizer.errors import UserError
from quantizer.pack.manifest import MANIFEST_NAME, FileRecord, Manifest
from quantizer.shipped import shipped

pytestmark = pytest.mark.slow  # builds a one-Spark pack (CPU encoding of every routed expert)

PLANNED = 4096
FULL = 1_048_576  # the tiny model's max positions, as the real model's
PLANNED_LINE = "at 4,096 tokens per stream, the context this pack was planned for (its build's --context)"
NO_RECORD = "at the model's full context, 1,048,576 tokens per stream: this pack records no planned context"


@pytest.fixture(scope="module")
def planned(tiny_v41, tmp_path_factory):
    """The tiny V4.1 model planned for native ExLlamaV3's V4.1 loader, built with `--sparks 1 --context 4096`,
    and a GB10 profile shrunk so that the pack fits one Spark at 4,096 tokens and not at the model's full context
    (the shipped profile fits this small pack at any context)."""
    root = tmp_path_factory.mktemp("planned")
    src = shutil.copytree(tiny_v41, root / "src")
    shutil.copy(shipped("small_model") / "tokenizer.json", src)  # the engine reads it from the pack
    assert main(["plan", str(src), "--synthetic", "--loader", EXLLAMAV3_V41, "--bpw", "1.6",
                 "--out", str(root / "plan.json")]) == 0
    pack = root / "pack"
    assert main(["build", str(src), "--plan", str(root / "plan.json"), "--sparks", "1", "--context", str(PLANNED),
                 "--margin", "0", "--no-calibrate", "--out", str(pack)]) == 0
    return pack, _between(pack, root / "small-spark.json")


def _between(pack, path):
    """The shipped profile with the visible memory set halfway between what the pack needs at PLANNED and at FULL."""
    data = json.loads(shipped("configs", "hardware", "gb10.json").read_text())
    cfg, stored = stored_from_pack(pack)
    launch = read_launch(pack)
    free = [evaluate(cfg, stored, Scenario(sparks=1, context=n, engine=EXLLAMAV3_V41, drafter="off",
                                           copy_pattern=launch.copy_pattern, mmap_min=launch.mmap_min),
                     load_hardware())[0].free_gib for n in (PLANNED, FULL)]
    assert free[0] - free[1] > 0.5  # the cache of 1M tokens, beside that of 4,096
    data["visible_gib"]["value"] -= sum(free) / 2
    path.write_text(json.dumps(data))
    return path


def _fit_section(card: str) -> str:
    section = card.split("## Fit on DGX Sparks\n", 1)[1]
    return section[: section.index("\n## ")]


def test_fit_pack_fits_at_its_planned_context_with_the_full_context_beside(planned, capsys):
    pack, hardware = planned
    assert Manifest.load(pack).plan["launch"]["context"] == read_launch(pack).context == PLANNED
    assert Manifest.load(pack).plan["planned"] == {"sparks": 1, "context": PLANNED, "streams": 1}
    capsys.readouterr()
    assert main(["fit", str(pack), "--hardware", str(hardware)]) == 0  # no --sparks: the one it was built for
    out = capsys.readouterr().out.splitlines()
    assert out[1] == PLANNED_LINE and "4,096 tokens x 1 stream(s)" in out[0]
    verdicts = [line for line in out if "FIT" in line]
    assert verdicts[0].startswith("FITS: fits 1 Spark (exllamav3-v41, tp) at 4,096 tokens x 1 stream;")
    assert verdicts[1].startswith("at the model's full context: DOES NOT FIT: does not fit 1 Spark (exllamav3-v41, "
                                  "tp) at 1,048,576 tokens x 1 stream: rank 0 is short by")
    assert main(["fit", str(pack), "--sparks", "1", "--hardware", str(hardware), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == PLANNED and data["fits"]


@pytest.mark.parametrize("context, code", [("1M", 1), ("2048", 0)])
def test_an_explicit_context_wins(planned, context, code, capsys):
    pack, hardware = planned
    capsys.readouterr()
    assert main(["fit", str(pack), "--sparks", "1", "--hardware", str(hardware), "--context", context]) == code
    out = capsys.readouterr().out
    tokens = 1_048_576 if context == "1M" else 2048
    assert f"{tokens:,} tokens x 1 stream(s)" in out.splitlines()[0]
    assert "planned for" not in out and "at the model's full context" not in out


def test_the_card_shows_the_planned_context_first_and_the_full_context_beside(planned, tmp_path, capsys):
    pack, hardware = planned
    table = pack_fit_table(pack, load_hardware(hardware))
    assert table["planned_context"] == PLANNED and table["planned"]["context"] == PLANNED and table["context"] == FULL
    assert table["planned"]["topologies"]["1"][EXLLAMAV3_V41]["fits"]
    assert not table["topologies"]["1"][EXLLAMAV3_V41]["fits"]
    fit = _fit_section(render_card(Manifest.load(pack), table))
    first, full = fit.index(PLANNED_LINE[0].upper() + PLANNED_LINE[1:]), fit.index("At the model's full context, "
                                                                                    "1,048,576 tokens and one stream")
    assert first < full
    rows = [re.split(r"\s{2,}", line) for line in fit.splitlines() if re.match(rf"1\s+{EXLLAMAV3_V41}\s", line)]
    assert [r[2] for r in rows] == ["yes", "no"]  # the planned row, then the full-context row
    copy = shutil.copytree(pack, tmp_path / "pack")  # `card` writes both tables under today's profile
    (copy / CARD_NAME).unlink()
    capsys.readouterr()
    assert main(["card", str(copy)]) == 0
    card = (copy / CARD_NAME).read_text()
    assert PLANNED_LINE[1:] in card and "At the model's full context, 1,048,576 tokens and one stream" in card
    assert main(["verify", str(copy)]) == 0


def test_a_pack_without_the_record_is_fitted_at_the_full_context_and_says_so(planned, tmp_path, capsys):
    """A pack that records nothing (no `planned` in its manifest, no CTX in its launch.env), as packs written before
    did: fitted at the full context, saying so in one line."""
    pack, hardware = planned
    old = shutil.copytree(pack, tmp_path / "old")
    env = old / LAUNCH_FILE
    env.write_text("".join(line for line in env.read_text().splitlines(keepends=True)
                           if not line.startswith(("CTX=", "CHUNK=", "# CTX"))))
    m = Manifest.load(old)
    m.files[LAUNCH_FILE] = FileRecord(env.stat().st_size, sha256_file(env))
    m.plan["launch"] |= {"context": None, "chunk": None}
    del m.plan["planned"]
    (old / MANIFEST_NAME).write_text(json.dumps(m.to_dict()))
    capsys.readouterr()
    assert main(["fit", str(old), "--sparks", "1", "--hardware", str(hardware)]) == 1  # as before: the full context
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(NO_RECORD) and "1,048,576 tokens x 1 stream(s)" in out[0]
    assert any(line.startswith("DOES NOT FIT: does not fit 1 Spark (exllamav3-v41, tp) at 1,048,576") for line in out)
    assert not [line for line in out if line.startswith("at the model's full context:")]
    table = pack_fit_table(old, load_hardware(hardware))
    assert table["planned_context"] is None and "planned" not in table
    fit = _fit_section(render_card(Manifest.load(old), table))
    assert fit.count("```") == 2 and NO_RECORD[1:] in fit


def test_a_pack_of_an_engine_that_maps_nothing_says_it_records_no_planned_context(tiny_v41, fp16_plan, tmp_path,
                                                                                 capsys):
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(pack), "--no-calibrate"]) == 0
    capsys.readouterr()
    assert main(["fit", str(pack), "--sparks", "1"]) == 0  # stock exllamav3: it copies every weight, no launch.env
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(NO_RECORD) and "1,048,576 tokens x 1 stream(s)" in out[0]
    assert NO_RECORD[1:] in (pack / CARD_NAME).read_text()


def test_a_pack_built_for_two_sparks_is_fitted_at_its_sparks_context_and_streams(tiny_v41, tmp_path, capsys):
    """Any engine's pack records what its build fitted: `fit PACK` with no flags answers at it."""
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--loader", "vllm-exl3", "--bpw", "3", "--method", "uniform", "--sparks", "2",
                 "--context", "8192", "--streams", "3", "--out", str(pack), "--no-calibrate"]) == 0
    assert Manifest.load(pack).planned.to_dict() == {"sparks": 2, "context": 8192, "streams": 3}
    capsys.readouterr()
    assert main(["fit", str(pack)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "8,192 tokens x 3 stream(s)" in out[0] and out[1].startswith("at 8,192 tokens per stream, the context")
    assert any(line.startswith("FITS: fits 2 Sparks") for line in out)
    assert any(line.startswith("at the model's full context: FITS") for line in out)
    assert "3 stream(s)" in _fit_section((pack / CARD_NAME).read_text())


@pytest.mark.parametrize("record", [{"sparks": 2}, {"sparks": "two", "context": 1, "streams": 1}, "2 Sparks"])
def test_a_malformed_planned_record_is_one_line(planned, record):
    """A hand-made manifest (its digest made again) with a planned record no build writes: one line, not a
    traceback, wherever it is read."""
    m = Manifest.load(planned[0])
    m.plan["planned"] = record
    with pytest.raises(UserError) as e:
        _ = m.planned
    assert str(e.value).startswith(f"{MANIFEST_NAME}: plan.planned ") and "rebuild the pack" in str(e.value)
