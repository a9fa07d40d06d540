"""Decode time of one DeepSeek-V4.1-shape routed-MoE layer in exllamav3 1.6.5's own kernels, by expert layout
(issue 58): 384 experts, 5120 -> 2304 -> 5120, top-6, at one row and at the drafter's verify rows (6).

Every layout is timed on exllamav3's per-expert path (what an engine runs for a layer whose experts differ in K:
sort the picks, then per expert LinearEXL3 gate, up, activation, down, scale and index_add, as
exllamav3/modules/block_sparse_mlp.py's torch path does); a layout whose experts share one K per projection with
gate = up is timed on the fused decode path too (BC_BlockSparseMLP.run_bszN: exl3_moe_coop's two launches), built
as BlockSparseMLP.load_local builds it. The ratio is the fused path's time over the per-expert path's on the same
layout, in the same process. Trellis codes are random (decode time does not depend on them). GPU only; writes the
table and --json.

    python bench/moe_decode_gpu.py [--iters 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

EXPERTS, HIDDEN, WIDTH, TOP_K = 384, 5120, 2304, 6
MAX_BSZN = 8  # exllamav3's fused decode tier (modules/block_sparse_mlp.py)
ACT_LIMIT = 10.0  # V4.1's swiglu clamp
HISTOGRAM_159 = {1: 27210, 2: 11811, 3: 5774, 4: 1221, 5: 62, 6: 2}  # the one-Spark 1.59 bpw pack's routed K


def layouts(rng: random.Random) -> dict[str, list[tuple[float, float, float]]]:
    """Layout name -> (K gate, K up, K down) of each expert."""
    ks, weights = zip(*HISTOGRAM_159.items())
    per_expert = [tuple(float(k) for k in rng.choices(ks, weights, k=3)) for _ in range(EXPERTS)]
    halves = [tuple(rng.choice((1.0, 1.5, 2.0, 2.5, 3.0, 3.5)) for _ in range(3)) for _ in range(EXPERTS)]
    grouped = [(k, k, k) for k in (1.0, 2.0, 3.0, 4.0) for _ in range(EXPERTS // 4)]
    return {
        "per-layer K2": [(2.0, 2.0, 2.0)] * EXPERTS,
        "per-layer K3": [(3.0, 3.0, 3.0)] * EXPERTS,
        "per-layer K2.5": [(2.5, 2.5, 2.5)] * EXPERTS,
        "per-layer K3/K3/K4": [(3.0, 3.0, 4.0)] * EXPERTS,
        "grouped K1-K4 (4 x 96)": grouped,
        "per-expert (the 1.59 pack's K)": per_expert,
        "per-expert with half rates": halves,
    }


def _width(k: float) -> int:
    """Trellis words per 16x16 tile: 16 K, and 16 floor(K) + 8 for a half rate (mul1)."""
    return 16 * int(k) + (8 if k != int(k) else 0)


def make_linear(in_f: int, out_f: int, k: float, marker: torch.Tensor):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    trellis = torch.randint(-32768, 32767, (in_f // 16, out_f // 16, _width(k)), dtype=torch.int16, device="cuda")
    suh = torch.randn(in_f, dtype=torch.half, device="cuda").sign()
    svh = torch.randn(out_f, dtype=torch.half, device="cuda") * 0.01
    inner = LinearEXL3(None, in_f, out_f, suh=suh, svh=svh, trellis=trellis, mul1=marker)
    return SimpleNamespace(inner=inner, quant_type="exl3", softcap=0.0, post_scale=1.0, in_features=in_f,
                           out_features=out_f)


def per_expert_step(gates, ups, downs, y, selected, weights) -> torch.Tensor:
    """The per-expert path of exllamav3's BlockSparseMLP (its torch path), one call."""
    flat_expert = selected.reshape(-1)
    flat_weight = weights.reshape(-1)
    flat_token = torch.arange(y.shape[0], device=y.device).repeat_interleave(TOP_K)
    order = flat_expert.argsort()
    token_sorted, weight_sorted = flat_token[order], flat_weight[order]
    counts = torch.bincount(flat_expert, minlength=EXPERTS).tolist()
    out = torch.zeros((y.shape[0], HIDDEN), dtype=torch.float, device=y.device)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        top_x = token_sorted[start:end]
        x = y.index_select(0, top_x)
        g = gates[e].inner.forward(x, {})
        u = ups[e].inner.forward(x, {})
        a = F.silu(g.clamp(max=ACT_LIMIT)) * u.clamp(-ACT_LIMIT, ACT_LIMIT)
        d = downs[e].inner.forward(a.half(), {}).float() * weight_sorted[start:end].unsqueeze(1)
        out.index_add_(0, top_x, d)
        start = end
    return out


def fused_block(gates, ups, downs):
    """BC_BlockSparseMLP with the buffers BlockSparseMLP.load_local gives it (no shared expert, no bias)."""
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.multilinear import MultiLinear

    dev = torch.device("cuda")
    mg, mu, md = (MultiLinear(dev, ls, allow_bias=True) for ls in (gates, ups, downs))
    rows = MAX_BSZN * TOP_K
    temp_hidden = torch.empty((max(64, rows), HIDDEN), dtype=torch.half, device=dev)
    temp_interm = torch.empty((max(64, 2 * rows), WIDTH), dtype=torch.half, device=dev)
    temp_activa = torch.empty((max(32, rows), WIDTH), dtype=torch.half, device=dev)
    temp_output = torch.empty((max(32, rows), HIDDEN), dtype=torch.float, device=dev)
    coop_ctr = torch.zeros((rows * (WIDTH // 128) + MAX_BSZN * (HIDDEN // 128) + 2 * rows + 3,), dtype=torch.int,
                           device=dev)
    had_u = torch.empty((rows, HIDDEN), dtype=torch.half, device=dev)
    out_bszn = torch.empty((MAX_BSZN, HIDDEN), dtype=torch.float, device=dev)
    dq_up = torch.empty((HIDDEN, WIDTH), dtype=torch.half, device=dev)

    def table(ls, what):
        return torch.tensor([getattr(l.inner, what).data_ptr() for l in ls])

    gu = [torch.stack((table(gates, w), table(ups, w)), dim=0).T.contiguous().to(dev) for w in ("trellis", "suh", "svh")]
    bc = ext.BC_BlockSparseMLP(
        temp_hidden, temp_hidden[:rows].view(rows, 1, HIDDEN), temp_interm, temp_interm[:rows].view(rows, 1, WIDTH),
        temp_interm[rows:2 * rows].view(rows, 1, WIDTH), temp_activa[:rows].view(rows, 1, WIDTH), temp_activa,
        temp_output[:rows].view(rows, 1, HIDDEN), temp_output, None, coop_ctr, had_u, dq_up, dq_up.view(WIDTH, HIDDEN),
        -1, -1,
        mg.ptrs_trellis, mg.ptrs_suh, mg.ptrs_svh, mg.K, mg.mcg, mg.mul1,
        mu.ptrs_trellis, mu.ptrs_suh, mu.ptrs_svh, mu.K, mu.mcg, mu.mul1,
        md.ptrs_trellis, md.ptrs_suh, md.ptrs_svh, md.K, md.mcg, md.mul1,
        True, False, False, None, None, ACT_LIMIT,
        [x.inner.bc for x in gates], [x.inner.bc for x in ups], [x.inner.bc for x in downs],
        gu[0], gu[1], gu[2], out_bszn)
    return bc, out_bszn


def timed(fn, iters: int) -> float:
    """Median microseconds of `fn` over `iters` calls after a warm-up, by CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def measure_layout(name: str, tuples: list[tuple[float, float, float]], marker: torch.Tensor, iters: int) -> list[dict]:
    """One layout's per-expert (and, where it qualifies, fused) decode times at 1 and 6 rows."""
    built = time.monotonic()
    gates = [make_linear(HIDDEN, WIDTH, kg, marker) for kg, _, _ in tuples]
    ups = [make_linear(HIDDEN, WIDTH, ku, marker) for _, ku, _ in tuples]
    downs = [make_linear(WIDTH, HIDDEN, kd, marker) for _, _, kd in tuples]
    uniform = len({t[0] for t in tuples}) == len({t[1] for t in tuples}) == len({t[2] for t in tuples}) == 1
    fused = None
    if uniform and tuples[0][0] == tuples[0][1]:
        try:
            fused = fused_block(gates, ups, downs)
        except Exception as e:  # noqa: BLE001 - a path this exllamav3 build refuses is reported, not fatal
            print(f"{name}: fused path not built ({type(e).__name__}: {e})", file=sys.stderr)
    weights_bytes = sum(in_f * out_f * k / 8 for t in tuples for in_f, out_f, k in
                        ((HIDDEN, WIDTH, t[0]), (HIDDEN, WIDTH, t[1]), (WIDTH, HIDDEN, t[2])))
    out = []
    for rows in (1, 6):
        y = torch.randn((rows, HIDDEN), dtype=torch.half, device="cuda")
        selected = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(rows)])
        weights = torch.full((rows, TOP_K), 1 / TOP_K, dtype=torch.half, device="cuda")
        loop_us = timed(lambda: per_expert_step(gates, ups, downs, y, selected, weights), iters)
        fused_us = None
        if fused:
            bc, result = fused
            fused_us = timed(lambda: bc.run_bszN(y, selected, weights), iters)
            reference = per_expert_step(gates, ups, downs, y, selected, weights)
            err = (result[:rows] - reference).abs().max().item() / max(reference.abs().max().item(), 1e-9)
            print(f"{name}, {rows} rows: fused against per-expert, max relative difference {err:.2e}", file=sys.stderr)
        out.append({"layout": name, "rows": rows, "per_expert_us": round(loop_us, 1),
                    "fused_us": None if fused_us is None else round(fused_us, 1),
                    "fused_over_per_expert": None if fused_us is None else round(fused_us / loop_us, 3),
                    "expert_gib": round(weights_bytes / 2**30, 3)})
    print(f"{name}: built and timed in {time.monotonic() - built:.1f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_decode_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    rng = random.Random(0)
    marker = torch.tensor([-2082680531], dtype=torch.int32, device="cuda")  # mul1
    results = []
    for name, tuples in layouts(rng).items():
        results += measure_layout(name, tuples, marker, args.iters)
        torch.cuda.empty_cache()
    reference = {r["rows"]: r["per_expert_us"] for r in results if r["layout"].startswith("per-expert (")}
    for r in results:
        best = r["fused_us"] or r["per_expert_us"]
        r["best_over_per_expert_layout"] = round(best / reference[r["rows"]], 3)
    width = max(len(r["layout"]) for r in results)
    print(f"{'layout':<{width}}  rows  per-expert us  fused us  fused/per-expert  best / per-expert layout  expert GiB")
    for r in results:
        fused = "-" if r["fused_us"] is None else f"{r['fused_us']:.1f}"
        ratio = "-" if r["fused_over_per_expert"] is None else f"{r['fused_over_per_expert']:.3f}"
        print(f"{r['layout']:<{width}}  {r['rows']:>4}  {r['per_expert_us']:>13.1f}  {fused:>8}  {ratio:>16}  "
              f"{r['best_over_per_expert_layout']:>24.3f}  {r['expert_gib']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
