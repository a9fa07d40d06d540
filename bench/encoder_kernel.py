"""Our CUDA tile encoder against exllamav3's `quantize_tiles`, on the same tiles in one process.

For each K of --ks and codebook of --codebooks: --tiles i.i.d. N(0,1) 16x16 tiles (the LDLQ inputs are
near that after the Hadamard rotations), encoded by exllamav3 1.6.5's generic kernel (what sm_90 runs by
default), by its optimized kernel (EXL3_QT_OPTIMIZED=1, switched in-process as bench/encoder_variants.py
does: the variable is read per launch, the scratch-buffer cache is cleared; at the half rates 1.5, 2.5
and 3.5, mul1 only, exllamav3 has one kernel, `quantize_tiles_frac`, timed as "generic") and by ours
(quantizer/codec/kernel). Each is warmed up once, then timed --repeat times (torch.cuda.synchronize
and perf_counter around the call; the best is kept), in weights per second; the ratio ours / generic and
ours / optimized; and whether our states and values are torch.equal to each of theirs. `--also NAME=PATH`
builds another version of our kernel (an earlier commit's, `git show REV:quantizer/codec/kernel/
trellis_encode.cu > PATH`) and times it beside them, with the ratio ours / NAME and its codes compared too.

On the GPU machine (about a minute plus our kernel's first build, about 1-2 minutes):

    source .device-cache/setup.sh && python bench/encoder_kernel.py

writes $OUT/encoder_kernel.json (or --json PATH). Without CUDA, exllamav3 or our kernel it says why in one
line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.codec import kernel
from quantizer.report import table

ENV = "EXL3_QT_OPTIMIZED"
QUANTIZE_MODULE = "exllamav3.modules.quant.exl3_lib.quantize"
CODEBOOK_ARGS = {"3inst": {}, "mcg": {"mcg": True}, "mul1": {"mul1": True}}
_layout: dict = {}  # the (variant, K, codebook) exllamav3's cached scratch buffers were laid out for


def exllamav3_encoder(variant: str):
    """exllamav3's quantize_tiles with its generic or optimized kernel forced (see the module docstring)."""
    q = importlib.import_module(QUANTIZE_MODULE)

    def run(tiles, K, codebook):
        saved = os.environ.get(ENV)
        os.environ[ENV] = "1" if variant == "optimized" else "0"
        try:
            if _layout.get("now") != (variant, K, codebook):
                q.get_temp_buffers.cache_clear()
                _layout["now"] = (variant, K, codebook)
            return q.quantize_tiles(tiles, {"K": K, **CODEBOOK_ARGS[codebook]})
        finally:
            if saved is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved
    return run


def ours(tiles, K, codebook):
    return kernel.encode_tiles(tiles, K, kernel.CODEBOOKS[codebook])


def other_version(path: Path):
    """Another version of our kernel, built from `path`, called as ours is. Versions before the half rates
    (2026-12-06) take (tiles, K, codebook, max_blocks), later ones (tiles, KA, KB, codebook, max_blocks);
    pybind's docstring gives the count."""
    module = kernel.build(path)
    params = module.encode_tiles.__doc__.split("(", 1)[1].split(")", 1)[0].count(",") + 1

    def run(tiles, K, codebook):
        if params == 4:
            if K in kernel.HALF_RATES:
                raise ValueError(f"{path.name}: a version without half rates")
            return module.encode_tiles(tiles, int(K), kernel.CODEBOOKS[codebook], 0)
        return module.encode_tiles(tiles, int(K), int(K) + (K != int(K)), kernel.CODEBOOKS[codebook], 0)
    run.half_rates = params != 4
    return run


def timed(fn, repeat: int):
    fn()  # warm-up: builds, scratch buffers
    torch.cuda.synchronize()
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(ks, codebooks, n_tiles: int, repeat: int, seed: int = 0, log=print, also: dict | None = None) -> list[dict]:
    """`also`: name -> encoder (other_version) of further versions of our kernel."""
    encoders = {"generic": exllamav3_encoder("generic"), "optimized": exllamav3_encoder("optimized"), "ours": ours,
                **(also or {})}
    rows = []
    for codebook in codebooks:
        for K in ks:
            half = K in kernel.HALF_RATES
            if half and codebook != "mul1":
                continue  # half rates are mul1-only, in exllamav3 and ours
            g = torch.Generator(device="cuda").manual_seed(seed + int(2 * K))
            tiles = torch.randn(n_tiles, 256, device="cuda", generator=g)
            row = {"K": K, "codebook": codebook, "tiles": n_tiles, "weights": n_tiles * 256}
            outs = {}
            for name, enc in encoders.items():
                if (half and name == "optimized") or (half and not getattr(enc, "half_rates", True)):
                    continue  # exllamav3 has one half-rate kernel; an earlier version of ours none
                sec, outs[name] = timed(lambda enc=enc: enc(tiles, K, codebook), repeat)
                row[f"{name}_s"] = sec
                row[f"{name}_weights_per_s"] = n_tiles * 256 / sec
            for ref in (n for n in encoders if n != "ours" and n in outs):
                row[f"ours_over_{ref}"] = row[f"{ref}_s"] / row["ours_s"]
                row[f"equal_{ref}"] = bool(torch.equal(outs["ours"][1], outs[ref][1]) and
                                           torch.equal(outs["ours"][0], outs[ref][0]))
                row[f"differing_tiles_{ref}"] = int((outs["ours"][1] != outs[ref][1]).any(dim=1).sum())
            rows.append(row)
            log(f"K {K:g} {codebook}: " + ", ".join(f"{n} {row[f'{n}_weights_per_s'] / 1e6:.1f}" for n in outs)
                + " M weights/s; " + ", ".join(f"ours/{n} {row[f'ours_over_{n}']:.2f}" for n in outs if n != "ours")
                + f"; codes equal {all(row[f'equal_{n}'] for n in outs if n != 'ours')}")
    return rows


def environment_error() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    try:
        importlib.import_module(QUANTIZE_MODULE)
    except Exception as e:  # noqa: BLE001 - any failure to import exllamav3: one line
        return f"needs exllamav3: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return kernel.unavailable_reason()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=float, nargs="+", default=[2, 3, 4, 2.5],
                    help="K 1-6, or the half rates 1.5, 2.5, 3.5 (mul1)")
    ap.add_argument("--codebooks", nargs="+", choices=sorted(CODEBOOK_ARGS), default=["mul1"])
    ap.add_argument("--tiles", type=int, default=8448, help="tiles per call (8448 = 64 per SM on an H100/H200)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per encoder (the best is kept)")
    ap.add_argument("--json", type=Path, default=None, help="report file (default: $OUT/encoder_kernel.json)")
    ap.add_argument("--also", nargs="*", default=[], metavar="NAME=PATH",
                    help="another version of our kernel's source to time beside it (e.g. an earlier commit's)")
    args = ap.parse_args(argv)
    also = {}
    for item in args.also:
        name, _, path = item.partition("=")
        if not name.isidentifier() or name in ("generic", "optimized", "ours") or not Path(path).is_file():
            ap.error(f"--also {item!r}: NAME=PATH with a new name and an existing .cu file")
        also[name] = Path(path)
    if bad := [f"{k:g}" for k in args.ks if k not in kernel.KS]:
        ap.error(f"--ks {' '.join(bad)}: our kernel does K 1-6, 1.5, 2.5 and 3.5")
    args.ks = [int(k) if k.is_integer() else k for k in args.ks]
    path = args.json or (Path(os.environ["OUT"]) / "encoder_kernel.json" if os.environ.get("OUT") else None)
    t0 = time.perf_counter()
    if why := environment_error():
        print(f"encoder_kernel: {why}", file=sys.stderr)
        raise SystemExit(2)
    try:
        also = {name: other_version(source) for name, source in also.items()}
    except kernel.KernelUnavailable as e:
        print(f"encoder_kernel: --also: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"our kernel ready in {time.perf_counter() - t0:.0f} s (build or load)", flush=True)
    from importlib.metadata import version

    rows = measure(args.ks, args.codebooks, args.tiles, args.repeat, log=lambda s: print(s, flush=True), also=also)
    report = {"bench": "bench/encoder_kernel.py", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "exllamav3": version("exllamav3"), "repeat": args.repeat, "rows": rows}
    if path:
        path.write_text(json.dumps(report, indent=1) + "\n")
    names = ["generic", "optimized", *also]

    def cell(r, key, fmt):
        return fmt(r[key]) if key in r else "-"

    print(table(["K", "codebook", *(f"{n} M w/s" for n in names), "ours M w/s", *(f"ours/{n}" for n in names),
                 "codes equal"],
                [[f"{r['K']:g}", r["codebook"], *(cell(r, f"{n}_weights_per_s", lambda v: f"{v / 1e6:.2f}") for n in names),
                  f"{r['ours_weights_per_s'] / 1e6:.2f}", *(cell(r, f"ours_over_{n}", lambda v: f"{v:.2f}") for n in names),
                  "yes" if all(r.get(f"equal_{n}", True) for n in names) else
                  f"NO ({r['differing_tiles_generic']} tiles)"] for r in rows]))
    return rows


if __name__ == "__main__":
    rows = main()
    raise SystemExit(0 if all(r["equal_generic"] for r in rows) else 1)
