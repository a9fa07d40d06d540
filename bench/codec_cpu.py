"""CPU benchmark of the EXL3 codec: the trellis encoder and the linear quantizer, as ratios measured in one run.

Encoder: tiles/s of exact and fast mode at K = 2, 3, 4 (mul1) on N(0,1) tiles, for the compiled kernel and
the pure-torch search (the fallback, and the previous encoder), with the speed ratios, the fast/exact MSE
ratio and the exact MSE against exllamav3's own numbers (docs/exl3-format.md, distortion).

Quantizer: weights/s of quantize_linear (one matrix per call) and quantize_linears (8 per call) on the
bundled small model's shapes, 128x256 and 512x128 (out x in) with a Hessian, against the floor: the same
matrices' tiles through encode_tiles alone. Wall and CPU time are both shown: on a shared machine the CPU
time is the steadier of the two. Also times the decoder on a V4.1 expert-sized tensor.

Against another kernel source (--against OLD.cpp, e.g. `git show REV:quantizer/codec/viterbi_kernel.cpp`):
both compiled with the same flags, tiles/s of each at K = 1.5, 2, 2.5, 3, 4, 6 on one thread and on all, the
ratio, and whether their states are identical.

    python bench/codec_cpu.py [--tiles 256] [--mode fast] [--no-torch] [--against OLD.cpp]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quantizer.codec import EXL3Linear, dequantize, encode_tiles, native, quantize_linear, quantize_linears
from quantizer.codec.trellis import step_bits
from quantizer.codec.viterbi import _EXACT_SEAM_WINDOW, FAST_SEAM_WINDOW, _encode_torch
from quantizer.exl3 import Codebook, codebook_values

EXLLAMAV3_MSE = {2: 0.068, 3: 0.0176, 4: 0.0046}  # quantize_tiles, mul1, N(0,1) tiles, one H200
SEAMS = {"exact": _EXACT_SEAM_WINDOW, "fast": FAST_SEAM_WINDOW}


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _rate(n: float, wall: float, cpu: float) -> str:
    return f"{n / wall:>9.0f} {n / cpu:>9.0f}"


def bench_encoder(n_tiles: int, with_torch: bool) -> None:
    tiles = torch.randn(n_tiles, 256, generator=torch.Generator().manual_seed(0))
    values = codebook_values("mul1").float()
    kernel = "C++ kernel" if native.kernel() is not None else "NO C++ kernel (torch fallback)"
    print(f"\nencoder: {n_tiles} N(0,1) tiles per run, mul1, {torch.get_num_threads()} threads, {kernel}")
    print(f"{'K':>3} {'mode':>5} {'path':>5} {'tiles/s':>9} {'/cpu-s':>9} {'rel. MSE':>9} {'vs exl3':>8} "
          f"{'vs exact':>9} {'vs torch':>9} {'MSE x':>6}")
    for K in (2, 3, 4):
        encode_tiles(tiles[:4], K, "mul1", "fast")  # build the kernel / workspaces outside the timing
        rows = {}
        for mode in ("exact", "fast"):
            paths = {"main": lambda: encode_tiles(tiles, K, "mul1", mode)}
            if with_torch:
                paths["torch"] = lambda: _encode_torch(tiles, K, Codebook.MUL1, SEAMS[mode])
            for path, fn in paths.items():
                states, wall, cpu = _timed(fn)
                mse = ((values[states.long()] - tiles).square().sum() / tiles.square().sum()).item()
                rows[mode, path] = (n_tiles / wall, n_tiles / cpu, mse)
        for (mode, path), (rate, cpu_rate, mse) in rows.items():
            exact = rows["exact", path]
            vs_torch = f"{cpu_rate / rows[mode, 'torch'][1]:>8.1f}x" if with_torch and path == "main" else f"{'':>9}"
            print(f"{K:>3} {mode:>5} {path:>5} {rate:>9.1f} {cpu_rate:>9.1f} {mse:>9.5f} {mse / EXLLAMAV3_MSE[K]:>8.3f} "
                  f"{cpu_rate / exact[1]:>8.2f}x {vs_torch} {mse / exact[2]:>6.3f}")
    print("(speed ratios use CPU time; 'vs torch' = compiled kernel over the torch search, same mode)")


def _compiled(source: Path, out: Path) -> native.Kernel:
    subprocess.run([native._compiler(), *native._FLAGS, "-o", str(out), str(source)], check=True)
    return native.Kernel(out)


def bench_against(source: Path, n_tiles: int) -> None:
    tiles = torch.randn(n_tiles, 256, generator=torch.Generator().manual_seed(0))
    values = codebook_values("mul1").float().contiguous()
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"this": _compiled(native.SOURCE, Path(tmp) / "this.so"),
                   "other": _compiled(source, Path(tmp) / "other.so")}
        print(f"\nkernel against {source}: {n_tiles} N(0,1) tiles, mul1, fast seam, tiles/s (CPU time)")
        print(f"{'K':>4} {'threads':>7} {'this':>9} {'other':>9} {'ratio':>7} {'same states':>12}")
        for K in (1.5, 2, 2.5, 3, 4, 6):
            for threads in sorted({1, torch.get_num_threads()}):
                runs = {}
                for name, kernel in kernels.items():
                    kernel.encode_tiles(tiles[:2], values, step_bits(K), FAST_SEAM_WINDOW, threads)
                    runs[name] = _timed(lambda: kernel.encode_tiles(tiles, values, step_bits(K), FAST_SEAM_WINDOW,
                                                                    threads))
                (mine, _, cpu_mine), (theirs, _, cpu_theirs) = runs["this"], runs["other"]
                print(f"{K:>4g} {threads:>7} {n_tiles / cpu_mine:>9.1f} {n_tiles / cpu_theirs:>9.1f} "
                      f"{cpu_theirs / cpu_mine:>6.2f}x {str(torch.equal(mine, theirs)):>12}")


def _layer(out_f: int, in_f: int, seed: int):
    """A weight with uneven output-channel scales and a correlated, uneven-variance input Hessian."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * (0.5 + torch.rand(out_f, 1, generator=g)) * 0.02
    mix = torch.eye(in_f) + 0.5 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
    x = torch.randn(1024, in_f, generator=g) * (0.2 + 2 * torch.rand(in_f, generator=g)) @ mix
    return w, (x.T @ x, x.shape[0])


def bench_linear(mode: str, batch: int = 8) -> None:
    print(f"\nquantize: {batch} matrices per shape, own Hessian each, mode {mode}, weights/s (wall, CPU)")
    print(f"{'shape':>8} {'K':>2} {'what':>26} {'w/s':>9} {'/cpu-s':>9} {'of floor':>9} {'proxy err':>10}")
    for out_f, in_f in ((128, 256), (512, 128)):
        layers = [_layer(out_f, in_f, seed) for seed in range(batch)]
        weights, hessians = [w for w, _ in layers], [h for _, h in layers]
        n = batch * out_f * in_f
        for K in (2, 3, 4):
            tiles = torch.randn(n // 256, 256, generator=torch.Generator().manual_seed(K))
            encode_tiles(tiles[:4], K, "mul1", mode)
            _, wall, cpu = _timed(lambda: encode_tiles(tiles, K, "mul1", mode))
            floor = n / cpu
            print(f"{out_f}x{in_f:<4} {K:>2} {'encode_tiles (floor)':>26} {_rate(n, wall, cpu)} {1.0:>8.2f}x")
            qs, wall, cpu = _timed(lambda: [quantize_linear(w, K, h, c, mode=mode, seed=i)
                                            for i, (w, (h, c)) in enumerate(layers)])
            single = n / cpu
            err = sum(q.proxy_err for q in qs) / batch
            print(f"{'':>8} {'':>2} {'quantize_linear x' + str(batch):>26} {_rate(n, wall, cpu)} "
                  f"{single / floor:>8.2f}x {err:>10.5f}")
            qs, wall, cpu = _timed(lambda: quantize_linears(weights, K, hessians, mode=mode, seeds=0))
            err = sum(q.proxy_err for q in qs) / batch
            print(f"{'':>8} {'':>2} {'quantize_linears (' + str(batch) + ')':>26} {_rate(n, wall, cpu)} "
                  f"{n / cpu / floor:>8.2f}x {err:>10.5f}  ({n / cpu / single:.2f}x quantize_linear)")


def bench_decode() -> None:
    g = torch.Generator().manual_seed(1)
    in_f, out_f, K = 5120, 2304, 3
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_f // 16, out_f // 16, 16 * K), generator=g, dtype=torch.int16)
    q = EXL3Linear(trellis, torch.rand(in_f, generator=g).half(), torch.rand(out_f, generator=g).half(), "mul1", K)
    dequantize(q)
    _, wall, cpu = _timed(lambda: dequantize(q))
    print(f"\ndecode: {out_f}x{in_f} K={K} to the original basis: {wall:.2f} s wall, {cpu:.2f} s CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=256, help="tiles per encoder run (default 256)")
    parser.add_argument("--mode", choices=("exact", "fast"), default="fast", help="encoder mode of the quantizer runs")
    parser.add_argument("--no-torch", action="store_true", help="skip the (slow) pure-torch encoder runs")
    parser.add_argument("--against", type=Path, help="another viterbi_kernel.cpp to compare the kernel with")
    args = parser.parse_args()
    if args.against and not args.against.is_file():
        parser.error(f"--against {args.against}: no such file")
    print(f"load average before the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.against:
        bench_against(args.against, args.tiles)
    bench_encoder(args.tiles, not args.no_torch)
    bench_linear(args.mode)
    bench_decode()
    print(f"load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
