"""The quantize stage on one full batch of real-shape routed experts: its GPU memory and time against what
it states.

The real model's largest quantize unit is one layer's routed experts of one projection at one K, as many
as GPU_BATCH_BYTES of fp32 weights hold (91 of V4.1-Flash's w1), each with its own Hessian under the
default calibration (gate2). bench/rehearsal.py's slice has 32 experts a layer, below that size. This
writes a full-width one-layer slice with a full batch of experts (random weights in the native formats, as
the rehearsal writes them), runs the quantize stage (ours, the default on CUDA) on its w1 at --k with a
random SPD Hessian per expert handed over from the host (as the calibration store hands them), and prints
the peak GPU memory against `quantize_gpu_memory` (goal: 0.75-1.25) and the unit's encoder seconds against
what `build` states for it (the encode-rate table measured on 16 experts).

    source .device-cache/setup.sh && python bench/quantize_gpu_memory.py --k 3

Writes $OUT/quantize_gpu_memory.json when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rehearsal import slice_config, write_slice  # noqa: E402
from v41_experts import IN, OUT, spd_hessian  # noqa: E402

from quantizer.calibrate.storage import HessianRecord  # noqa: E402
from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.codec.kernel import KS  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.contract.loader_profiles import VLLM_EXL3, load_profile  # noqa: E402
from quantizer.contract.pack_spec import pack_spec  # noqa: E402
from quantizer.contract.plan import Plan  # noqa: E402
from quantizer.model.targets import ROUTED, targets  # noqa: E402
from quantizer.quantize.encode_hours import RateTable, estimate  # noqa: E402
from quantizer.quantize.linears import GPU_BATCH_BYTES, work_units  # noqa: E402
from quantizer.quantize.pipeline import PREFETCH_UNITS  # noqa: E402
from quantizer.quantize.settings import QuantizeSettings  # noqa: E402
from quantizer.quantize.stage import quantize, quantize_gpu_memory  # noqa: E402
from quantizer.report import GIB, table  # noqa: E402
from quantizer.workdir import write_json_atomic  # noqa: E402

FULL_BATCH = GPU_BATCH_BYTES // (4 * IN * OUT)  # 91 experts' w1


def batch_plan(cfg: ModelConfig, k: float) -> Plan:
    """Only the layer's routed w1 at K; no engine loads such a plan, so it is made without a profile's
    checks (as bench/quantize_gpu.py's; the per-expert layout of vllm-exl3 decides the units)."""
    keys = {t.key for t in targets(cfg) if t.group == ROUTED and t.key.startswith("layers.") and t.key.endswith(".w1")}
    return Plan(cfg.arch, "mul1", load_profile(VLLM_EXL3), {t.key: (k if t.key in keys else None) for t in targets(cfg)})


def statements(cfg: ModelConfig, plan: Plan) -> dict:
    """What the stage states for the plan: its units, GPU memory (gate2: one Hessian per expert) and seconds."""
    linears = pack_spec(cfg, plan).encoded
    units = work_units(linears, "cuda")
    by_key = {s.key: s for s in linears}
    return {"units": [u.name for u in units], "weights": sum(u.weights for u in units),
            "gpu_memory": quantize_gpu_memory(units, by_key, PREFETCH_UNITS, True),
            "seconds": estimate(linears, RateTable.load()).seconds}


def measure(root: Path, k: float) -> dict:
    write_slice(root / "src", slice_config(1, FULL_BATCH), seed=0)
    ck = Checkpoint.open(root / "src")
    plan = batch_plan(ck.config, k)
    stated = statements(ck.config, plan)
    device = torch.device("cuda", torch.cuda.current_device())
    keys = [s.key for s in pack_spec(ck.config, plan).encoded]
    hessians = {}
    for i, key in enumerate(keys):
        h, count = spd_hessian(IN, device, seed=100 + i)
        hessians[key] = (h.cpu(), count)
        del h
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    settings = QuantizeSettings(device="cuda", hessians=HessianRecord("synthetic", 0, 0, expert_inputs=True))  # as gate2 pins
    result = quantize(ck, plan, root / "work", settings, hessian=hessians.__getitem__)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"device": torch.cuda.get_device_name(), "k": k, "experts": FULL_BATCH, **stated,
            "gpu_peak": torch.cuda.max_memory_allocated() - before, "stage_s": seconds,
            "unit_seconds": result.unit_seconds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=float, default=3.0, help="the batch's K (ours covers K 1-6 and 1.5, 2.5, 3.5)")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args(argv)
    if args.k not in KS:
        ap.error(f"--k {args.k:g}: our kernel covers K {', '.join(f'{k:g}' for k in KS)}")
    if os.environ.get("OUT") and not Path(os.environ["OUT"]).is_dir():
        ap.error(f"$OUT={os.environ['OUT']} is not a directory: the report goes there")
    if not torch.cuda.is_available():
        sys.exit("quantize_gpu_memory.py needs a CUDA GPU (and exllamav3)")
    root = Path(tempfile.mkdtemp(prefix="quantize-gpu-memory-", dir=args.tmp))
    try:
        r = measure(root, args.k)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    encoder_s = sum(r["unit_seconds"].values())
    print(f"\n{r['device']}: {r['experts']} experts' w1 at K {r['k']:g} in {len(r['units'])} unit(s), "
          f"{r['weights']:,} weights")
    print(table(["", "stated", "measured", "ratio"], [
        ["GPU memory", f"{r['gpu_memory'] / GIB:,.2f} GiB", f"{r['gpu_peak'] / GIB:,.2f} GiB",
         f"{r['gpu_memory'] / r['gpu_peak']:.2f}"],
        ["encoder seconds", f"{r['seconds']:,.1f}", f"{encoder_s:,.1f}", f"{r['seconds'] / encoder_s:.2f}"]]))
    print(f"stage {r['stage_s']:,.1f} s in all; {r['weights'] / encoder_s / 1e6:,.2f} M weights/s in the encoder")
    if os.environ.get("OUT"):
        write_json_atomic(Path(os.environ["OUT"]) / "quantize_gpu_memory.json", r)
    return r


if __name__ == "__main__":
    main()
