"""The README is a page a new user reads in one sitting, and its "Pick your pack" table says what `plan`
says: for each row's build command, the same flags given to `plan --synthetic` print the row's bits,
pack sizes and GPU-hours (issue 41)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from quantizer.cli import main

README = Path(__file__).parents[1] / "README.md"
SOURCE = "deepseek-ai/DeepSeek-V4.1-Flash"
PLAN_FLAGS = ("--sparks", "--context", "--overlay", "--loader")  # the build flags that decide the plan


def pick_rows() -> list[dict[str, str]]:
    """The "Pick your pack" table as {column: cell} per row."""
    text = README.read_text()
    section = text.split("## Pick your pack", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def plan_args(build_cell: str) -> list[str]:
    """`plan` on the real V4.1 config with the flags of a row's build command that decide the plan."""
    words = shlex.split(build_cell.strip("`"))
    assert words[:3] == ["quantizer", "build", SOURCE], build_cell
    args = ["plan", "--model-config", "deepseek-v4.1-flash", "--synthetic"]
    for i, word in enumerate(words):
        if word in PLAN_FLAGS:
            takes_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            args += [word, words[i + 1]] if takes_value else [word]
    return args


def test_the_readme_fits_one_sitting_with_the_pack_table_on_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert any(line == "## Pick your pack" for line in lines[:60])
    assert [row["Sparks"] for row in pick_rows()] == ["1", "2", "4"]


@pytest.mark.parametrize("row", pick_rows(), ids=lambda row: f"{row['Sparks']}-sparks")
def test_each_pack_row_is_what_plan_prints_for_its_build_flags(row, capsys):
    args = plan_args(row["build"])
    assert f"--sparks {row['Sparks']}" in " ".join(args) and f"--context {row['context']}" in " ".join(args)
    main(args)
    out = capsys.readouterr().out
    bits = re.match(r"[\d.]+", row["bits"])[0]
    without, total = re.findall(r"[\d.]+(?= GiB)|[\d.]+(?= /)", row["pack, without / with the 189 GiB Engram tables"])
    hours = re.search(r"~([\d.]+) GPU-hours", row["quantize, one GPU"])[1]
    rate, drafted = re.match(r"~([\d.]+), ([\d.]+) with the drafter", row["decode, tokens/s (model)"]).groups()
    assert re.search(rf"^decode \(a model, docs/decode-speed.md\): ~{re.escape(rate)} tokens/s, {re.escape(drafted)} "
                     "with the drafter", out, re.M), out
    assert f"{bits} bpw plan" in out, out[:400]
    assert re.search(rf"^without Engram tables\s+{re.escape(without)}$", out, re.M), out
    assert re.search(rf"^total\s+{re.escape(total)}$", out, re.M), out
    assert re.match(rf"quantize: [\d.,]+ G weights, ~{re.escape(hours)} GPU-hours on ", default_quantize_line(out)), out


def default_quantize_line(out: str) -> str:
    """`plan`'s first quantize line: the hours with the default encoder (the other encoder's line follows)."""
    return next(line for line in out.splitlines() if line.startswith("quantize: "))


def test_the_tensorfold_alternative_is_what_plan_prints(capsys):
    note = README.read_text().split("add `--loader tensorfold` (2 Sparks at 1M:", 1)[1].split("\n- ", 1)[0]
    bits = re.search(r"([\d.]+) bits over every budgeted tensor", note)[1]
    without = re.search(r"([\d.]+) GiB without the tables", note)[1]
    hours = re.search(r"~([\d.]+) GPU-hours", note)[1]
    rate, drafted = re.search(r"~([\d.]+) tokens/s, ([\d.]+)\s+with the drafter", note).groups()
    main(["plan", "--model-config", "deepseek-v4.1-flash", "--synthetic", "--sparks", "2", "--context", "1M",
          "--loader", "tensorfold"])
    out = capsys.readouterr().out
    assert f"decode (a model, docs/decode-speed.md): ~{rate} tokens/s, {drafted} with the drafter" in out, out
    assert f"{bits} bpw plan" in out, out[:400]
    assert re.match(rf"quantize: [\d.,]+ G weights, ~{re.escape(hours)} GPU-hours on ", default_quantize_line(out)), out
    assert re.search(rf"^without Engram tables\s+{re.escape(without)}$", out, re.M), out
