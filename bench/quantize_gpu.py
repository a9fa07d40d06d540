"""Encode rates per K on one GPU, and our quantize stage against exllamav3's `quantize_exl3_batch`.

Sixteen real-shape V4.1 routed experts are generated on the GPU: their w1 (in 5120, out 2304) stored
as a native MXFP4 checkpoint (what the real model ships), with a random SPD Hessian each as the default
calibration (`gate2`) gives every expert's gate/up its own (`--w1-hessians shared`: one for all, as
`--expert-hessians shared` and exllamav3 do; the encoder factors each distinct Hessian, so shared is
faster), and their w2 (in 2304, out 5120, a Hessian each under either calibration).

- rates: the --encoder's batch conversion on the dequantized fp32 weights already on the GPU (ours by
  default: exllamav3's steps with the Hessians kept on the GPU and our tile kernel; exllamav3: its
  `quantize_exl3_batch`), for every K of --ks (the mul1 grid,
  half-integer rates included, by default) and both shapes; written as the encode-rate table the
  GPU-hours statements of `plan` and `build` read (configs/encode_rates/<encoder>.json);
- at --compare-ks, on the same w1 tensors: `quantize_exl3_batch` with exllamav3's own kernel (the
  reference every ratio divides by), the same with our kernel, our conversion (and whether both results
  are torch.equal to the reference's), and `quantizer.quantize.quantize` on the checkpoint with a plan naming the 16 w1
  tensors (job file, source fingerprint, reading and dequantizing the FP4 bytes, the exllamav3 adapter,
  saving the results: everything a build does per unit) with --encoder exllamav3 (the stage's overhead:
  >= 0.9) and with --encoder ours (the speed-up issue 39 asks for: >= 2.5 at K 2, 3 and 4, >= 2 at K 2.5
  and 3.5).

On the GPU machine (about 6 minutes; --ks splits the grid over several calls):

    source .device-cache/setup.sh && python bench/quantize_gpu.py

writes $OUT/quantize_gpu.json (every measurement) and $OUT/encode_rates.json (the table), rewritten after
each measurement so that a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from v41_experts import EXPERTS, IN, KEYS, OUT, W1_HESSIANS, encode, w1_hessians, w2_hessians, w2_weights, write_source

from quantizer.codec.exllamav3_batch import quantize_exl3_batch_on_device
from quantizer.codec.kernel import in_exllamav3

from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.loader_profiles import VLLM_EXL3, load_profile
from quantizer.contract.plan import Plan
from quantizer.exl3 import rate_grid
from quantizer.model.targets import targets
from quantizer.quantize.encode_hours import RATES_FORMAT
from quantizer.quantize.settings import ENCODERS, QuantizeSettings
from quantizer.quantize.stage import quantize
from quantizer.report import table
from quantizer.workdir import write_json_atomic

COMPARE_KS = (2.0, 2.5, 3.0, 3.5, 4.0)
HOWS = ("exllamav3", "kernel", "ours")  # the batch conversions `direct` runs


def direct(weights, hessians, K: float, device: torch.device, how: str) -> tuple[float, list]:
    """Seconds and results of one batch conversion on the weights already on the GPU: `how` "exllamav3",
    its `quantize_exl3_batch`; "kernel", the same with our tile kernel; "ours", our loop with our kernel
    (what --encoder ours runs)."""
    if how == "exllamav3":
        seconds, results, _ = encode(weights, hessians, K, device)
    else:
        with in_exllamav3():
            seconds, results, _ = encode(weights, hessians, K, device,
                                         quantize_exl3_batch_on_device if how == "ours" else None)
    return seconds, results


def same_results(a: list, b: list) -> bool:
    """Two calls' (proxy error, tensors) per weight, equal bit for bit."""
    return all(pa == pb and da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
               for (pa, da), (pb, db) in zip(a, b))


def stage(src: Path, work: Path, hessians, K: float, device: torch.device, encoder: str) -> float:
    """Seconds of the quantize stage on the 16 w1 tensors; `hessians` as for `encode`."""
    ck = Checkpoint.open(src)
    # Only these 16 experts' w1, at every K of the grid (half rates too): no engine loads such a plan, so
    # it is made without a profile's checks; the per-expert layout of vllm-exl3 decides the units.
    k = {t.key: (K if t.key in KEYS else None) for t in targets(ck.config)}
    plan = Plan(ck.config.arch, "mul1", load_profile(VLLM_EXL3), k)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    quantize(ck, plan, work, QuantizeSettings(device="cuda", encoder=encoder),
             hessian=lambda key: hessians if isinstance(hessians, tuple) else hessians[KEYS.index(key)])
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def rate_table(rates: list[dict], device: torch.device, w1_hessians: str, encoder: str) -> dict:
    """The measured rates in the format of configs/encode_rates/*.json."""
    from importlib.metadata import version

    return {
        "format": RATES_FORMAT, "version": 1, "device": torch.cuda.get_device_name(device),
        "encoder": (f"exllamav3 {version('exllamav3')}'s batch conversion (LDLQ, trellis search, packing), mul1, "
                    + ("run by quantizer/codec/exllamav3_batch.py (the Hessians on the GPU), tile search in our kernel "
                       "(quantizer/codec/kernel)" if encoder == "ours" else "quantize_exl3_batch with its own kernel")),
        "measured_by": "bench/quantize_gpu.py (the batch conversion called directly on the dequantized weights "
                       "already on the GPU)",
        "source": f"{datetime.date.today().isoformat()}: {EXPERTS} random routed experts of DeepSeek-V4.1-Flash's "
                  f"shapes; w1 (in 5120) with {W1_HESSIANS[w1_hessians]}, w2 (in 2304) with one SPD Hessian each",
        "rates": [{k: r[k] for k in ("K", "in_features", "out_features", "batch", "weights_per_s")} for r in rates],
        # ours: the K not measured here are priced at exllamav3's own table (quantizer/quantize/encode_hours.py)
        **({"fallback": "exllamav3"} if encoder == "ours" else {}),
    }


def write_reports(rates: list[dict], compared: list[dict], device: torch.device, args) -> None:
    """$OUT/quantize_gpu.json and $OUT/encode_rates.json with what is measured so far (rewritten after each
    measurement, so that a run cut short by the GPU machine's time limit keeps what it measured)."""
    if not os.environ.get("OUT"):
        return
    out = Path(os.environ["OUT"])
    write_json_atomic(out / "quantize_gpu.json", {"rates": rates, "compared": compared})
    if rates:
        write_json_atomic(out / "encode_rates.json", rate_table(rates, device, args.w1_hessians, args.encoder))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", type=float, nargs="+", default=list(rate_grid("mul1")), help="K values to measure")
    ap.add_argument("--compare-ks", type=float, nargs="*", default=list(COMPARE_KS),
                    help="K values at which the stage is compared with the direct call")
    ap.add_argument("--w1-hessians", choices=sorted(W1_HESSIANS), default="each",
                    help="each: one Hessian per expert's w1 (calibration's default, gate2); shared: one for all")
    ap.add_argument("--encoder", choices=ENCODERS["cuda"], default="ours",
                    help="the batch conversion the rates are measured with (the stage's --encoder)")
    args = ap.parse_args()
    if os.environ.get("OUT") and not Path(os.environ["OUT"]).is_dir():
        ap.error(f"$OUT={os.environ['OUT']} is not a directory: the reports go there")
    device = torch.device("cuda", 0)
    n_weights = EXPERTS * IN * OUT
    rates, compared = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        w1 = write_source(tmp / "src", device)
        w2 = w2_weights(device)
        h1 = w1_hessians(device, args.w1_hessians)
        h2 = w2_hessians(device)
        for how in HOWS:  # warm-up: kernels (ours built), streams, pinned buffers
            direct(w1[:2], h1 if isinstance(h1, tuple) else h1[:2], 2, device, how)
        for K in args.ks:
            for ws, hs, (i, o) in ((w1, h1, (IN, OUT)), (w2, h2, (OUT, IN))):
                seconds, _ = direct(ws, hs, K, device, args.encoder)
                rates.append({"K": K, "in_features": i, "out_features": o, "batch": EXPERTS,
                              "seconds": seconds, "weights_per_s": n_weights / seconds})
                print(f"K {K:g}  in {i}  {n_weights / seconds / 1e6:.2f} M weights/s", flush=True)
                write_reports(rates, compared, device, args)
        for e in ENCODERS["cuda"] if args.compare_ks else ():  # warm-up: the stage's one-off costs, untimed
            stage(tmp / "src", tmp / f"warm-{e}", h1, args.compare_ks[0], device, e)
        for K in args.compare_ks:
            t_ref, ref = direct(w1, h1, K, device, "exllamav3")
            t_kernel, got_kernel = direct(w1, h1, K, device, "kernel")
            t_ours, got = direct(w1, h1, K, device, "ours")
            t_stage = {e: stage(tmp / "src", tmp / f"work-K{K:g}-{e}", h1, K, device, e) for e in ENCODERS["cuda"]}
            compared.append({"K": K, "weights": n_weights, "direct_s": t_ref, "direct_kernel_s": t_kernel,
                             "direct_ours_s": t_ours, "stage_exllamav3_s": t_stage["exllamav3"],
                             "stage_ours_s": t_stage["ours"], "direct_weights_per_s": n_weights / t_ref,
                             "ours_weights_per_s": n_weights / t_stage["ours"], "direct_kernel_ratio": t_ref / t_kernel,
                             "direct_ours_ratio": t_ref / t_ours, "stage_exllamav3_ratio": t_ref / t_stage["exllamav3"],
                             "ratio": t_ref / t_stage["ours"],
                             "codes_equal": same_results(ref, got_kernel) and same_results(ref, got)})
            print(f"K {K:g}  stage ours {t_ref / t_stage['ours']:.2f}x quantize_exl3_batch, codes equal "
                  f"{compared[-1]['codes_equal']}", flush=True)
            write_reports(rates, compared, device, args)
    print(f"{EXPERTS} experts, mul1, {torch.cuda.get_device_name(device)}: --encoder {args.encoder}, M weights/s")
    by_k = {}
    for r in rates:
        by_k.setdefault(r["K"], {})[r["in_features"]] = r["weights_per_s"] / 1e6
    print(table(["K", f"w1 (in {IN})", f"w2 (in {OUT})"],
                [[f"{k:g}", f"{v.get(IN, 0):.2f}", f"{v.get(OUT, 0):.2f}"] for k, v in by_k.items()]))
    if compared:
        print("\nagainst quantize_exl3_batch with exllamav3's own kernel on the same w1 tensors (x = its time / ours)")
        print(table(["K", "exllamav3 Mw/s", "direct, our kernel", "direct, ours", "stage, exllamav3", "stage, ours",
                     "codes equal"],
                    [[f"{c['K']:g}", f"{c['direct_weights_per_s'] / 1e6:.2f}", f"{c['direct_kernel_ratio']:.2f}x",
                      f"{c['direct_ours_ratio']:.2f}x", f"{c['stage_exllamav3_ratio']:.2f}x", f"{c['ratio']:.2f}x",
                      "yes" if c["codes_equal"] else "NO"] for c in compared]))


if __name__ == "__main__":
    main()
