"""One full-size DeepSeek-V4.1-Flash layer on a GPU: time, achieved FLOP/s and peak memory.

Random bf16 weights are built directly on the device for one compressed layer (default: layer 2,
a ratio-2 kv + index source; layer 20 is the ratio-1 candidate source) and 16 rows x 2048 tokens
go through it twice: with top-k routing, and in the all-expert calibration mode (every token
through every routed expert). A bf16 8192^3 matmul measured in the same run is the reference;
the ratio is model FLOPs (quantizer/model/flops.py) per second over the matmul's FLOP/s. Peak
memory is torch's max allocated during a mode, the layer's weights (~27 GiB) included.

    python bench/forward_gpu_layer.py                 # H200: full size
    python bench/forward_gpu_layer.py --tiny          # any machine: tiny shapes, checks the logic

Needs only python3 + torch (the repository root is put on sys.path). Writes
$OUT/forward_gpu_layer.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.block import Block
from quantizer.model.flops import layer_flops
from quantizer.model.hooks import ForwardHooks
from quantizer.model.state import ForwardState
from quantizer.model.transformer import init_parameters
from quantizer.report import table

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny-v41 shapes, 2 x 64 tokens, any device")
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--rows", type=int)
    p.add_argument("--cols", type=int)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also print the top operators of the top-k pass")
    return p.parse_args(argv)


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def best(self, fn, repeat: int) -> float:
        """Best wall time of `repeat` calls after one warm-up call, in seconds."""
        fn()
        times = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return min(times)


def matmul_rate(n: int, device: torch.device, timer: Timer, repeat: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timer.best(lambda: a @ b, max(repeat, 3))


def random_block(cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> Block:
    with torch.device("meta"):
        block = Block(cfg, layer, dtype)
    block = block.to_empty(device=device)
    init_parameters(block, seed=layer)
    return block


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def profile(fn, device: torch.device) -> None:
    """Where the time of one pass goes: the top operators by device (or CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), torch_profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


def main(argv=None) -> dict:
    args = parse(argv)
    config = "tiny-v41.json" if args.tiny else "deepseek-v4.1-flash.json"
    cfg = ModelConfig.from_file(ROOT / "configs" / "models" / config)
    rows = args.rows or (2 if args.tiny else 16)
    cols = args.cols or (64 if args.tiny else 2048)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device.type != "cuda":
        sys.exit("forward_gpu_layer: no CUDA device; run with --tiny to check the logic on a CPU")
    if args.layer in cfg.engram_layer_ids:
        sys.exit(f"forward_gpu_layer: layer {args.layer} has Engram tables, which stream from disk; pick another layer")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device)
    reference = matmul_rate(256 if args.tiny else 8192, device, timer, args.repeat)

    block = random_block(cfg, args.layer, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (rows, cols), device=device, generator=gen)
    streams = torch.randn(rows, cols, cfg.hc_mult, cfg.hidden_size, device=device, generator=gen)

    results = []
    for mode, hooks in (("top-k", None), ("all experts", ForwardHooks(all_experts=True))):
        def step(hooks=hooks):
            state = ForwardState.start(cfg, tokens, dtype)
            with torch.no_grad():
                return block(streams, state, None, hooks)

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds = timer.best(step, args.repeat)
        out = step()
        flops = rows * layer_flops(cfg, args.layer, cols, all_experts=hooks is not None)
        results.append({
            "mode": mode, "seconds": seconds, "tflop": flops / 1e12, "tflops": flops / seconds / 1e12,
            "ratio_to_matmul": flops / seconds / reference, "peak_gib": (peak_bytes(device) or 0) / 2**30,
            "finite": bool(torch.isfinite(out).all()),
        })
    if args.profile:
        profile(lambda: block(streams, ForwardState.start(cfg, tokens, dtype), None, None), device)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": config, "layer": args.layer, "ratio": cfg.ratio(args.layer),
        "rows": rows, "cols": cols, "dtype": str(dtype).replace("torch.", ""),
        "matmul_tflops": reference / 1e12, "results": results,
    }
    print(f"{report['device']}  layer {args.layer} (ratio {cfg.ratio(args.layer)})  {rows} x {cols} tokens  "
          f"{report['dtype']}  reference matmul {reference / 1e12:.3f} TFLOP/s")
    print(table(["mode", "ms", "TFLOP", "TFLOP/s", "of matmul", "peak GiB", "finite"],
                [[r["mode"], f"{r['seconds'] * 1e3:.1f}", f"{r['tflop']:.2f}", f"{r['tflops']:.3f}",
                  f"{r['ratio_to_matmul']:.0%}", f"{r['peak_gib']:.1f}", r["finite"]] for r in results]))
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "forward_gpu_layer.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
