"""The block-wise tune stage (`build --tune`) on one full-size DeepSeek-V4.1-Flash block: seconds per step and
per block, peak GPU memory against `tune_memory`, and the 40 blocks' hours on one GPU.

Random float32 weights are made on the device for one trunk layer (default 2: no Engram, no hash
routing); every linear a uniform --bpw plan stores gets a random trellis at its K, decoded on the device
as the stage decodes a stored one; the rows the stage keeps of a real build's 250 x 2048 calibration
(TuneSettings.split: 40 tuning + 16 held out with the defaults) get random streams. Then the stage's own
steps run in its order (quantizer/tune/stage.py): the native block's targets, its encoded weights
dropped, the codes decoded in their place, and `tune_block` with the default settings and early stopping
off, so every step and held-out measurement is paid: the most a block can take. Its peak GPU memory is
compared with `tune_memory` less the embedding (the stage holds it, this bench does not), its time with
`block_seconds` (which includes reading the block from the checkpoint, which this bench does not do).

References measured in the same run:
- the native block's forward over the same rows (the targets' pass), so the block's cost reads in forwards;
- with --previous-experts E, the same steps at E routed experts with the previous implementation (every
  weight built as svh * M * suh each step, `ForwardHooks.weight_override`) beside the current one
  (scales on the activations, `ForwardHooks.scaled_codes`): the speed-up per step. The previous one holds
  the block three times, so it is compared where that fits.

    python bench/tune_block_gpu.py --experts 192 --previous-experts 48     # H200: about 3 minutes
    python bench/tune_block_gpu.py --tiny                    # any machine: tiny shapes, checks the logic

Writes $OUT/tune_block_gpu.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from forward_gpu_layer import Timer, random_block  # noqa: E402

from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.codec import EXL3Linear  # noqa: E402
from quantizer.codec.trellis import words_per_tile  # noqa: E402
from quantizer.contract.pack_spec import pack_spec  # noqa: E402
from quantizer.contract.stored_linear import StoredLinear
from quantizer.exl3 import UNQUANTIZED  # noqa: E402
from quantizer.model.hooks import ForwardHooks, ScaledCodes  # noqa: E402
from quantizer.model.state import ForwardState  # noqa: E402
from quantizer.model.streaming import block_weight_bytes  # noqa: E402
from quantizer.plan.uniform import uniform_plan  # noqa: E402
from quantizer.report import GIB, table  # noqa: E402
from quantizer.tune.block import BlockLinears, QuantizedBlock, join_linears, tune_block  # noqa: E402
from quantizer.tune.factor import factor, unit_scaled  # noqa: E402
from quantizer.tune.settings import TuneSettings  # noqa: E402
from quantizer.tune.stage import DTYPE, _targets, block_seconds, drop_native_weights, tune_memory, tune_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL_ROWS, REAL_COLS = 250, 2048  # a real build's calibration (bench/rehearsal.py)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny-v41 shapes, 64-token rows, any device")
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--bpw", type=float, default=2.9)
    p.add_argument("--steps", type=int, default=TuneSettings.steps)
    p.add_argument("--experts", type=lambda v: [int(e) for e in v.split(",")], default=[],
                   help="also run blocks of these routed expert counts (comma-separated): the stated time between sizes")
    p.add_argument("--previous-experts", type=int, help="also time the previous implementation at this many experts")
    return p.parse_args(argv)


def layer_linears(cfg: ModelConfig, layer: int, bpw: float) -> tuple[list[StoredLinear], str]:
    """The linears a uniform `bpw` plan stores for block `layer`, and the plan's codebook."""
    plan = uniform_plan(cfg, bpw)
    return [s for s in pack_spec(cfg, plan).encoded if s.key.startswith(f"layers.{layer}.")], plan.codebook


def random_linears(stored: list[StoredLinear], codebook: str, device: torch.device) -> BlockLinears:
    """These stored linears with random trellises (random fp16 weights for K 16), decoded on `device`."""
    gen = torch.Generator(device=device).manual_seed(0)
    exl3, fixed, sources = {}, {}, {}
    for s in stored:
        if s.K == UNQUANTIZED:
            w = torch.randn(s.out_features, s.in_features, device=device, generator=gen) * 0.02
            fixed[s.key] = unit_scaled(w.half())
        else:
            shape = (s.in_features // 16, s.out_features // 16, words_per_tile(s.K))
            trellis = torch.randint(-2 ** 15, 2 ** 15, shape, dtype=torch.int16, device=device, generator=gen)
            suh = (torch.rand(s.in_features, device=device, generator=gen) * 0.1 + 0.05).half()
            svh = (torch.rand(s.out_features, device=device, generator=gen) * 0.1 + 0.05).half()
            exl3[s.key] = factor(EXL3Linear(trellis, suh, svh, codebook, s.K))
        sources.setdefault(f"{s.target.key}.weight", []).append(s.key)
    return join_linears(exl3, fixed, sources)


def previous_hooks(linears: BlockLinears, suh: dict | None = None, svh: dict | None = None) -> ForwardHooks:
    """The previous implementation: every stored linear's weight built whole at these scales, then swapped in."""
    def scale(key, given, leaf):
        if given is not None and key in given:
            return given[key]
        return getattr(linears.exl3[key] if key in linears.exl3 else linears.fixed[key], leaf).float()

    weights = {k: ScaledCodes(c.codes, scale(k, suh, "suh"), scale(k, svh, "svh")).weight()
               for k, c in (linears.exl3 | linears.fixed).items()}

    def override(name: str, _native: torch.Tensor) -> torch.Tensor | None:
        keys = linears.sources.get(name)
        if keys is None:
            return None
        return weights[keys[0]] if len(keys) == 1 else torch.cat([weights[k] for k in keys])
    return ForwardHooks(weight_override=override)


class PreviousBlock(QuantizedBlock):
    def hooks(self, suh=None, svh=None) -> ForwardHooks:
        return previous_hooks(self.linears, suh, svh)


def batches(cfg: ModelConfig, rows: int, cols: int, batch_rows: int, device: torch.device, seed: int) -> list:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        tokens = torch.randint(3, cfg.vocab_size, (n, cols), device=device, generator=gen)
        streams = torch.randn(n, cols, cfg.hc_mult, cfg.hidden_size, device=device, generator=gen)
        out.append((streams, ForwardState.start(cfg, tokens, DTYPE)))
    return out


def run_block(cfg: ModelConfig, args, device: torch.device, rows: int, cols: int, settings: TuneSettings,
              block_class=QuantizedBlock) -> dict:
    """The stage's steps on one block; seconds of each part and the peak memory."""
    timer = Timer(device)
    n_tune, n_held = settings.split(rows)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    block = random_block(cfg, args.layer, DTYPE, device)
    block.requires_grad_(False)
    tune_in = batches(cfg, n_tune, cols, settings.batch_rows, device, 1)
    held_in = batches(cfg, n_held, cols, settings.batch_rows, device, 2)
    parts = {}

    def timed(name, fn):
        timer.sync()
        t0 = time.perf_counter()
        value = fn()
        timer.sync()
        parts[name] = time.perf_counter() - t0
        return value

    tune_t, tune_x, _ = timed("targets (native forward)", lambda: _targets(block, None, tune_in, "native"))
    held_t, held_x, _ = timed("held-out targets", lambda: _targets(block, None, held_in, "native"))
    stored, codebook = layer_linears(cfg, args.layer, args.bpw)
    drop_native_weights(block, {f"{s.target.key}.weight" for s in stored})
    linears = timed("decode codes", lambda: random_linears(stored, codebook, device))
    qb = block_class(block, linears, None)
    steps = []
    result = timed("tune_block", lambda: tune_block(qb, tune_x, tune_t, held_x, held_t, settings,
                                                     lambda step, s: (timer.sync(), steps.append(s))))
    gaps = sorted(b - a for a, b in zip([0.0, *steps], steps))
    step_s = gaps[len(gaps) // 2]  # the median step: most have no held-out measurement after them
    return {"experts": cfg.n_routed_experts, "tune_rows": n_tune, "heldout_rows": n_held, "cols": cols,
            "parts_s": parts, "step_s": step_s, "steps": result.steps, "block_s": sum(parts.values()),
            "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            # the stage's statement less the embedding its rows start from, which this bench does not hold
            "estimate": tune_memory(cfg, rows, cols, settings) - cfg.vocab_size * cfg.hidden_size * 4,
            "block_bytes": block_weight_bytes(cfg, DTYPE)[f"layers.{args.layer}"],
            "block_s_estimate": block_seconds(block_weight_bytes(cfg, DTYPE)[f"layers.{args.layer}"], rows, cols, settings)}


def main(argv=None) -> dict:
    args = parse(argv)
    config = "tiny-v41.json" if args.tiny else "deepseek-v4.1-flash.json"
    cfg = ModelConfig.from_file(ROOT / "configs" / "models" / config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device.type != "cuda":
        sys.exit("tune_block_gpu: no CUDA device; run with --tiny to check the logic on a CPU")
    if args.layer in cfg.engram_layer_ids or cfg.is_hash_layer(args.layer):
        sys.exit(f"tune_block_gpu: layer {args.layer} has Engram tables or hash routing; pick another layer")
    rows, cols = (16, 64) if args.tiny else (REAL_ROWS, REAL_COLS)
    # every step and held-out measurement paid: the most a block can take
    settings = TuneSettings(steps=args.steps, patience=args.steps // TuneSettings.eval_every + 1)
    full = run_block(cfg, args, device, rows, cols, settings)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "config": config, "layer": args.layer, "bpw": args.bpw,
              "settings": settings.record(), "full": full,
              "hours_all_blocks_1gpu": cfg.num_layers * full["block_s"] / 3600,
              "hours_estimate": tune_seconds(cfg, rows, cols, settings) / 3600}
    runs = [("full", full)]
    for experts in args.experts:
        report.setdefault("current_at", []).append(
            run_block(dataclasses.replace(cfg, n_routed_experts=experts), args, device, rows, cols, settings))
        runs.append((f"current @ {experts} experts", report["current_at"][-1]))
    if args.previous_experts:
        small = dataclasses.replace(cfg, n_routed_experts=args.previous_experts)
        report["at_experts"] = {"current": run_block(small, args, device, rows, cols, settings),
                                "previous": run_block(small, args, device, rows, cols, settings, PreviousBlock)}
        runs += [(f"{k} @ {v['experts']} experts", v) for k, v in report["at_experts"].items()]
    print(f"{report['device']}  layer {args.layer}  {full['tune_rows']} + {full['heldout_rows']} rows x {cols}  "
          f"{settings.steps} steps, held-out every {settings.eval_every}")
    print(table(["run", "step s", "block s", "estimate s", "ratio", *full["parts_s"], "peak GiB", "estimate GiB",
                 "peak/estimate"],
                [[name, f"{r['step_s']:.3f}", f"{r['block_s']:.1f}", f"{r['block_s_estimate']:.1f}",
                  f"{r['block_s_estimate'] / r['block_s']:.2f}", *(f"{s:.1f}" for s in r["parts_s"].values()),
                  f"{(r['peak'] or 0) / GIB:.1f}", f"{r['estimate'] / GIB:.1f}",
                  f"{(r['peak'] or 0) / r['estimate']:.2f}"] for name, r in runs]))
    print(f"{cfg.num_layers} blocks on one GPU, every step paid: {report['hours_all_blocks_1gpu']:.2f} h measured "
          f"(this block's time x {cfg.num_layers}), {report['hours_estimate']:.2f} h stated (tune_seconds); a block is "
          f"{full['block_s'] / full['parts_s']['targets (native forward)']:.1f}x its native forward over the tuning rows")
    if "at_experts" in report:
        a = report["at_experts"]
        print(f"at {args.previous_experts} experts, a step: previous {a['previous']['step_s']:.3f} s, current "
              f"{a['current']['step_s']:.3f} s ({a['previous']['step_s'] / a['current']['step_s']:.2f}x)")
    out_dir = os.environ.get("OUT")
    if out_dir:
        (Path(out_dir) / "tune_block_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
