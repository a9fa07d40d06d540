"""Forward throughput of a small model on the CPU: tokens/s of the whole model and of streaming.

The reference measured in the same run is a float32 1024^3 matmul; the ratio is the forward's model
FLOPs per second (quantizer/model/flops.py, head included) over that matmul rate.

    python bench/forward_cpu.py                 # tiny V4.1 from make_tiny (random weights)
    python bench/forward_cpu.py --model DIR     # any native checkpoint, e.g. the bundled model
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.checkpoint.source import Checkpoint
from quantizer.model.flops import model_flops
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.model.transformer import DeepseekModel
from quantizer.report import table
from quantizer.tiny.make import make_tiny


def best_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="native checkpoint directory (default: a fresh tiny V4.1)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_tiny(Path(tmp) / "tiny-v41", "v41")
        ck = Checkpoint.open(path)
        cfg = ck.config
        model = DeepseekModel.from_checkpoint(ck)
        tokens = torch.randint(3, cfg.vocab_size, (args.rows, args.cols), generator=torch.Generator().manual_seed(0))
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        matmul = 2 * 1024 ** 3 / best_time(lambda: a @ b, 5)
        with torch.no_grad():
            whole = best_time(lambda: model(tokens), args.repeat)
        streamer = LayerStreamer(CheckpointSource(ck), progress=False, report=lambda line: None)
        streamed = best_time(lambda: list(streamer.row_logits(tokens)), args.repeat)
    n = args.rows * args.cols
    flops = model_flops(cfg, args.rows, args.cols)
    print(f"{path if args.model else 'tiny-v41 (make_tiny)'}: {args.rows} x {args.cols} tokens, float32, "
          f"{torch.get_num_threads()} threads; reference matmul {matmul / 1e9:.1f} GFLOP/s")
    print(table(["path", "seconds", "tokens/s", "GFLOP/s", "of matmul"],
                [[name, f"{t:.3f}", f"{n / t:,.0f}", f"{flops / t / 1e9:.1f}", f"{flops / t / matmul:.0%}"]
                 for name, t in (("whole model", whole), ("streamed", streamed))]))


if __name__ == "__main__":
    main()
