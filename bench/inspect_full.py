"""Inspect and fit on the full-size V4.1-Flash layout (96,085 tensors, 48 shards as sparse files),
timed against the physical floor of header parsing measured in the same run: reading the 48
headers and json-decoding them, nothing else.

    python bench/inspect_full.py [--repeat 3]

Prints seconds (best of --repeat) and each step's ratio to the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import struct
import tempfile
import time
from pathlib import Path

from quantizer.checkpoint.safetensors_file import read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main as cli
from quantizer.fit.memory import FitTarget, fit
from quantizer.fit.stored import stored_from_pack
from quantizer.inventory.classify import take_inventory
from quantizer.report import table
from quantizer.tiny.make import make_tiny


def header_floor(shards: list[Path]) -> int:
    """Read each shard's header bytes and decode the JSON: what any reader must do."""
    n = 0
    for shard in shards:
        with open(shard, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            n += len(json.loads(f.read(size)))
    return n


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def quiet_cli(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return cli(argv)


def run(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ck_dir = make_tiny(Path(tmp) / "full-v41", "v41", full_size=True, sparse=True)
        made = time.perf_counter() - start
        shards = sorted(ck_dir.glob("*.safetensors"))
        header_floor(shards)  # warm the page cache for every step alike
        steps = [
            ("header floor: read + json.loads x48", lambda: header_floor(shards)),
            ("read_header x48 (validated entries)", lambda: [read_header(s) for s in shards]),
            ("Checkpoint.open", lambda: Checkpoint.open(ck_dir)),
            ("take_inventory(Checkpoint.open)", lambda: take_inventory(Checkpoint.open(ck_dir))),
            ("quantizer inspect", lambda: quiet_cli(["inspect", str(ck_dir)])),
            ("stored_from_pack + fit (2 Sparks)", lambda: fit(*stored_from_pack(ck_dir), FitTarget(2, 1 << 20, 1, "vllm-exl3"))),
            ("quantizer fit PACK --sparks 2", lambda: quiet_cli(["fit", str(ck_dir), "--sparks", "2"])),
        ]
        times = [(name, best(repeat, fn)) for name, fn in steps]
    floor = times[0][1]
    print(f"full-size sparse V4.1 layout written in {made:.1f} s (96,085 tensors, {len(shards)} shards)")
    print(table(["step", "seconds", "x header floor"], [[n, f"{t:.3f}", f"{t / floor:.1f}"] for n, t in times]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    run(parser.parse_args().repeat)
