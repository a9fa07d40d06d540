"""The README is a page a new user reads in one sitting, and its "Pick your pack" tables say what `plan`
says: for each row's build command, the same flags given to `plan --synthetic` print the row's bits,
pack sizes and decode rate (issue 41), and the build's whole price: the GPU to rent, each stage's hours,
peak memory and disk, and whether a Spark can build it (issue 61). Its fit example does what it says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from quantizer.cli import main

README = Path(__file__).parents[1] / "README.md"
SOURCE = "deepseek-ai/DeepSeek-V4.1-Flash"
PLAN_FLAGS = ("--sparks", "--context", "--overlay", "--loader")  # the build flags that decide the plan


def pick_tables() -> list[list[dict[str, str]]]:
    """The tables of "Pick your pack", each as {column: cell} per row: the packs, then what each build costs."""
    text = README.read_text()
    section = text.split("## Pick your pack", 1)[1].split("\n## ", 1)[0]
    tables, lines = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            header = [c.strip() for c in lines[0].strip("|").split("|")]
            tables.append([dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in lines[2:]])
            lines = []
    return tables


def pick_rows() -> list[dict[str, str]]:
    """The pack table, each row joined with the price row of its Spark count."""
    packs, prices = pick_tables()
    price = {row["Sparks"]: row for row in prices}
    return [row | price[row["Sparks"]] for row in packs]


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
    rate, drafted = re.match(r"~([\d.]+), ([\d.]+) with the drafter", row["decode, tokens/s (model)"]).groups()
    assert re.search(rf"^decode \(a model, docs/decode-speed.md\): ~{re.escape(rate)} tokens/s, {re.escape(drafted)} "
                     "with the drafter", out, re.M), out
    assert f"{bits} bpw plan" in out, out[:400]
    assert re.search(rf"^without Engram tables\s+{re.escape(without)}$", out, re.M), out
    assert re.search(rf"^total\s+{re.escape(total)}$", out, re.M), out
    hours = re.fullmatch(r"~([\d.]+) h", row["quantize"])[1]
    assert re.match(rf"quantize: [\d.,]+ G weights, ~{re.escape(hours)} GPU-hours on ", default_quantize_line(out)), out
    assert_price(row, out)


def assert_price(row: dict[str, str], out: str) -> None:
    """The price row is `plan`'s build price block, cell by cell."""
    price = {m[1]: m[2] for m in re.finditer(r"^  (GPU to rent|calibrate|quantize|in all|on a Spark) +(.*)$", out, re.M)}
    assert price["GPU to rent"].startswith(row["GPU to rent"] + " ("), price
    assert price["calibrate"].startswith(row["calibrate"] + " on one "), price
    assert price["quantize"].startswith(row["quantize"] + " on one "), price
    gpu, ram = re.match(r"([\d.,]+), ([\d.,]+) GiB", row["peak GPU memory, RAM"]).groups()
    assert f"peak {gpu} GiB GPU memory, {ram} GiB RAM" in price["calibrate"], price
    assert price["in all"].startswith(row["in all"] + " "), price
    assert f"disk at the peak {row['disk at the peak']}" in price["in all"], price
    assert price["on a Spark"].startswith(row["can a Spark build it"]), price


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


def test_the_fit_example_fits_and_its_larger_sibling_says_what_does(capsys):
    """"Pick your pack"'s fit example: the smaller pack fits (exit 0); the larger exits 1 naming the bits that fit."""
    text = " ".join(README.read_text().split("What fits where, before any build:", 1)[1].split("\n- ", 1)[0].split())
    command = re.search(r"`quantizer (fit [^`]+)` fits; at `(--bpw [\d.]+)` it exits 1", text)
    args = shlex.split(command[1])
    assert main(args) == 0
    assert "FITS:" in capsys.readouterr().out
    larger = args[:args.index("--bpw")] + command[2].split() + args[args.index("--bpw") + 2:]
    assert main(larger) == 1
    hint = re.search(r'"(--bpw [\d.]+ fits 2 Sparks)"', text)[1]
    assert hint in capsys.readouterr().out
