"""Calibration memory: what `calibrate` states before it starts against what it holds, moment by moment.

Builds DeepSeek-V4.1-Flash slices (bench/rehearsal.py's slice: one Engram layer, one drafter block)
with every width divided by --scale points' factor (hidden, expert width, q/o ranks, heads, indexer
heads, vocabulary, Engram head width; head_dim, ratios, window, top-k and hc_mult kept), random
weights in the native formats, and runs the real calibration (`quantizer.calibrate.calibrate`) on it
under bench/live_bytes.py, which sums the live torch storages exactly. Each moment that
calibrate/needs.py models (Engram, attention, MoE, site gains, finishing a layer, the head) is
metered as a phase; per point the table gives the estimate and the measured peak of each, the run's
peak and its parts (weights, Hessian sums, this chunk's activations, streams + state + kept inputs),
and the process's resident-set growth as a second opinion (it adds the allocator's and Python's
own memory, and the bytes copies of the files written). Then `quantizer ppl`'s perplexity runs on the
same slice and its peak is printed beside the streamed forward's estimate (LayerStreamer.estimate).

On the CPU the model runs in float32 (what `calibrate --device cpu` uses) or, with dtype bf16, in
bfloat16: the CUDA path's tensors, measured on the CPU (the attention's key padding of CUDA is
not applied there, so the estimate is computed without it). With --device cuda (a GPU machine) it
meters CUDA tensors as the device and CPU tensors as the host staging, beside
torch.cuda.max_memory_allocated.

    python bench/calibrate_memory.py                 # the CPU points, about 2.5 minutes on 2 cores
    python bench/calibrate_memory.py --real          # and the real width, 1 row x 256 tokens (~5 GiB)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_bytes import LiveBytes, Peak  # noqa: E402

from quantizer.calibrate import collect, stage  # noqa: E402
from quantizer.calibrate.needs import CalibrationNeeds, calibration_needs  # noqa: E402
from quantizer.calibrate.settings import EXPERT_HESSIANS, CalibrationSettings  # noqa: E402
from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.model import attention, block, engram, moe  # noqa: E402
from quantizer.model.engram import engram_primes  # noqa: E402
from quantizer.model.streaming import CheckpointSource, LayerStreamer, MemoryEstimate  # noqa: E402
from quantizer.ppl.perplexity import perplexity  # noqa: E402
from quantizer.report import table  # noqa: E402
from quantizer.shipped import model_config_path  # noqa: E402
from quantizer.tiny.make import random_values  # noqa: E402
from quantizer.tiny.native_writer import write_native_checkpoint  # noqa: E402

MIB = 1 << 20
REAL = "deepseek-v4.1-flash.json"
ENGRAM_HASH_VOCAB = 40_000  # about a million 256-wide table rows at full width instead of 384 million
# the moments calibrate/needs.py names, and the phase each is metered as
MOMENTS = ("loading", "engram", "attention", "moe", "site gains", "site check", "expert inputs", "finishing", "head")
# torch.allclose's workspace is made inside one ATen kernel, where the meter does not see it: the
# site check's estimate is not compared here (a CUDA run's max_memory_allocated includes it)
UNSEEN = ("site check",)


@dataclass(frozen=True)
class Point:
    layers: int
    experts: int
    scale: int  # widths divided by this
    rows: int
    cols: int
    chunk: int  # rows per chunk
    dtype: str  # "fp32" (calibrate --device cpu) or "bf16" (the CUDA path's dtype)

    def __str__(self) -> str:
        return (f"{self.layers} layer(s) x {self.experts} experts, width 1/{self.scale}, {self.rows} x {self.cols} "
                f"tokens, chunks of {self.chunk} row(s), {self.dtype}")


POINTS = (
    Point(1, 8, 8, 4, 512, 2, "bf16"),
    Point(2, 8, 8, 2, 1024, 1, "fp32"),
    Point(1, 16, 4, 2, 1024, 2, "bf16"),
    Point(1, 32, 8, 1, 2048, 1, "bf16"),
    Point(2, 8, 8, 4, 256, 4, "fp32"),
    Point(1, 8, 2, 2, 512, 1, "bf16"),  # the widths at which routed experts are EXL3 targets (moe_intermediate 1152)
)
REAL_POINT = Point(1, 8, 1, 1, 256, 1, "bf16")


def slice_config(layers: int, experts: int, scale: int, base: str = REAL) -> dict:
    """A shipped config.json (the real one by default) cut to `layers` trunk layers of `experts` experts
    (layer 1 Engram, ratios 2, 1, 2, ..., one drafter block) with its widths divided by `scale` (1, 2, 4
    or 8 for the real one; a scaled slice keeps one vision layer)."""
    raw = json.loads(model_config_path(base).read_text())
    text = raw["text_config"]
    ratios = [2 if i % 2 == 0 else 1 for i in range(layers)]
    sources = list(range(min(2, layers)))
    text.update({
        "num_hidden_layers": layers, "n_routed_experts": experts, "compress_ratios": ratios + [0],
        "num_nextn_predict_layers": 1, "kv_source_layer_ids": sources, "index_source_layer_ids": sources,
        "candidate_source_layer_id": 1 if layers > 1 else None,
        "dspark_target_layer_ids": [layers - 1], "dspark_n_routed_experts": min(experts, text["dspark_n_routed_experts"]),
        "engram_layer_ids": [min(1, layers - 1)],
        "engram_vocab_size": min(text["engram_vocab_size"], ENGRAM_HASH_VOCAB),
    })
    for key in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "o_lora_rank", "dspark_markov_rank",
                "engram_head_dim", "num_attention_heads", "index_n_heads"):
        text[key] //= scale
    text["vocab_size"] = text["vocab_size"] // scale // 128 * 128  # the head stays a quantizable target
    text["engram_compressed_vocab_size"] = text["vocab_size"]
    vision = raw.get("vision_config")
    if vision and scale > 1:
        vision.update(num_hidden_layers=1, hidden_size=vision["hidden_size"] // scale,
                      intermediate_size=vision["intermediate_size"] // scale)
    text["engram_num_embeddings"] = [0]
    text["engram_num_embeddings"] = [sum(engram_primes(ModelConfig.from_dict(raw))[0])]
    return raw


class ModelDtype(CalibrationSettings):
    """Calibration settings whose model dtype is bfloat16 on any device (the CUDA path's, on the CPU)."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16


def settings_for(point: Point, device: str, expert_hessians: str = CalibrationSettings.expert_hessians
                 ) -> CalibrationSettings:
    kind = ModelDtype if point.dtype == "bf16" and device == "cpu" else CalibrationSettings
    return kind(device=device, measure_kl=False, row_chunk=point.chunk, expert_hessians=expert_hessians)


@contextmanager
def metered(live: LiveBytes):
    """Each moment of the calibration run as a phase of `live`; every block call advances its chunk."""
    def phase(owner, name: str, label: str, advance: bool = False):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if advance:
                live.chunk += 1
            with live.in_phase(label):
                return original(*args, **kwargs)
        setattr(owner, name, wrapped)
        return lambda: setattr(owner, name, original)

    undo = [phase(stage, "load_block", "loading"), phase(collect.LayerCollector, "__init__", "collector"),
            phase(block.Block, "forward", "block", advance=True), phase(engram.Engram, "forward", "engram"),
            phase(attention.Attention, "forward", "attention"), phase(moe.MoE, "forward", "moe"),
            phase(collect.LayerCollector, "_site_gains", "site gains"),
            phase(collect.LayerCollector, "_finish_expert_inputs", "expert inputs"),
            phase(collect.LayerCollector, "finish", "finishing"), phase(stage, "write_stats_file", "writing"),
            phase(stage, "_head", "head"), phase(stage, "save_chunk", "resume")]
    try:
        with live:
            yield live
    finally:
        for restore in undo:
            restore()


def measure(ck: Checkpoint, tokens: torch.Tensor, work: Path, settings: CalibrationSettings,
            device_types: tuple[str, ...] = ("cpu",)) -> LiveBytes:
    """One calibration run under the live-bytes meter, its moments as phases."""
    with metered(LiveBytes(device_types)) as live:
        stage.calibrate(ck, tokens, work, settings, progress=False)
    return live


def measure_streamer(ck: Checkpoint, tokens: torch.Tensor, settings: CalibrationSettings, chunk: int,
                     device_types: tuple[str, ...]) -> tuple[LiveBytes, MemoryEstimate]:
    """`quantizer ppl`'s perplexity over the streamed forward (no Hessians), metered, and the streamer's
    estimate (which counts ppl's log-probabilities of a row beside the next row's logits)."""
    streamer = LayerStreamer(CheckpointSource(ck), settings.device, settings.dtype, row_chunk=chunk, progress=False,
                             report=lambda line: None)
    with LiveBytes(device_types) as live:
        perplexity(streamer, tokens.to(settings.device))
    return live, streamer.estimate(*tokens.shape)


def parts(peak: Peak) -> dict[str, int]:
    """A peak's live bytes by what they are: weights (read and dequantized), Hessian sums (made with
    the collector), activations (made while the peak's row chunk ran), the rest (streams, state, kept
    inputs, made before)."""
    out = dict.fromkeys(("weights", "Hessian sums", "activations", "streams + state + kept"), 0)
    for (phase, chunk, site), size in peak.by_label.items():
        if site.startswith(("dequant.", "safetensors_file.")):
            out["weights"] += size
        elif phase == "collector":
            out["Hessian sums"] += size
        elif chunk == peak.chunk and phase not in ("start", "loading"):
            out["activations"] += size
        else:
            out["streams + state + kept"] += size
    return out


def estimated_parts(needs: CalibrationNeeds) -> dict[str, int]:
    s = needs.stream
    return {"weights": s.weights, "Hessian sums": needs.hessians, "activations": s.activations,
            "streams + state + kept": s.states + needs.extras}


def by_moment(needs: CalibrationNeeds) -> dict[str, int]:
    """The estimate's moments, each the highest over layers ("layer 3 moe" -> "moe")."""
    out: dict[str, int] = {}
    for name, size in needs.moments:
        kind = name.split(" ", 2)[2] if name.startswith("layer ") else name
        out[kind] = max(out.get(kind, 0), size)
    return out


def metered_estimate(needs: CalibrationNeeds) -> int:
    """The estimate's highest moment among those the meter sees (UNSEEN left out)."""
    return max(size for name, size in needs.moments if not name.endswith(UNSEEN))


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_point(point: Point, root: Path, device: str, expert_hessians: str, seed: int = 0) -> dict:
    raw = slice_config(point.layers, point.experts, point.scale)
    cfg = ModelConfig.from_dict(raw)
    src = root / "src"
    write_native_checkpoint(src, raw, random_values(cfg, torch.Generator().manual_seed(seed)), 2)
    ck = Checkpoint.open(src)
    tokens = torch.randint(0, cfg.vocab_size, (point.rows, point.cols), generator=torch.Generator().manual_seed(seed))
    settings = settings_for(point, device, expert_hessians)
    needs = calibration_needs(cfg, point.rows, point.cols, settings)
    kinds = ("cpu",) if device == "cpu" else ("cuda", "cpu")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")  # resident-set high-water mark from here
    rss_start, start = _rss("VmRSS"), time.perf_counter()
    live = measure(ck, tokens, root / "work", settings, kinds)
    seconds = time.perf_counter() - start
    shutil.rmtree(root / "work", ignore_errors=True)
    streamed, streamer_estimate = measure_streamer(ck, tokens, settings, point.chunk, kinds)
    shutil.rmtree(src, ignore_errors=True)
    main = kinds[0]
    estimated = by_moment(needs)
    report = {
        "point": str(point), "seconds": seconds, "moment": needs.stream.moment,
        "moments": {m: {"estimate": estimated.get(m, 0), "measured": live.phases.get(m, {}).get(main).bytes
                        if m in live.phases else 0} for m in MOMENTS},
        "peak": {"estimate": metered_estimate(needs), "measured": live.peak[main].bytes},
        "device_estimate": needs.device,
        "parts": {"estimate": estimated_parts(needs), "measured": parts(live.peak[main])},
        "rss_above_start": _rss("VmHWM") - rss_start,
        "streamer": {"estimate": streamer_estimate.total, "moment": streamer_estimate.moment,
                     "measured": streamed.peak[main].bytes},
        "ram_estimate": needs.ram(device),
    }
    if device == "cuda":
        report["host"] = {"estimate": needs.ram_staging, "measured": live.peak["cpu"].bytes}
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return report


def _ratio(estimate: int, measured: int) -> str:
    if not measured:
        return "-"
    r = estimate / measured
    return f"{r:.2f}" + ("" if 0.75 <= r <= 1.33 else " OFF")


def print_point(r: dict) -> None:
    print(f"\n{r['point']}: {r['seconds']:.1f} s; estimated peak {r['device_estimate'] / MIB:,.1f} MiB at {r['moment']}")
    rows = [[m, f"{v['estimate'] / MIB:,.1f}", "not seen" if m in UNSEEN else f"{v['measured'] / MIB:,.1f}",
             "" if m in UNSEEN else _ratio(v["estimate"], v["measured"])]
            for m, v in r["moments"].items() if v["estimate"] or v["measured"]]
    p = r["peak"]
    rows.append(["PEAK (moments seen)", f"{p['estimate'] / MIB:,.1f}", f"{p['measured'] / MIB:,.1f}",
                 _ratio(p["estimate"], p["measured"])])
    print(table(["moment (live tensor MiB)", "estimated", "measured", "ratio"], rows))
    est, got = r["parts"]["estimate"], r["parts"]["measured"]
    print(table(["at the peak", "estimated MiB", "measured MiB"],
                [[k, f"{est[k] / MIB:,.1f}", f"{got[k] / MIB:,.1f}"] for k in est]))
    line = f"resident set above start {r['rss_above_start'] / MIB:,.1f} MiB (RAM estimate {r['ram_estimate'] / MIB:,.1f})"
    if "host" in r:
        h = r["host"]
        line += (f"; host tensors {h['measured'] / MIB:,.1f} MiB against {h['estimate'] / MIB:,.1f} estimated; "
                 f"max_memory_allocated {r['max_memory_allocated'] / MIB:,.1f} MiB")
    print(line)
    t = r["streamer"]
    print(f"ppl's streamed forward: {t['estimate'] / MIB:,.1f} MiB estimated at {t['moment']}, "
          f"{t['measured'] / MIB:,.1f} MiB measured: ratio {_ratio(t['estimate'], t['measured'])}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--real", action="store_true", help="also the real width at 1 x 256 tokens (about 5 GiB)")
    ap.add_argument("--only", type=int, help="run only this point (index into the list)")
    ap.add_argument("--expert-hessians", choices=tuple(EXPERT_HESSIANS), default=CalibrationSettings.expert_hessians,
                    help="the routed experts' Hessians (calibrate's option; default: its default)")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out-json", type=Path)
    args = ap.parse_args(argv)
    points = list(POINTS) + ([REAL_POINT] if args.real else [])
    if args.only is not None:
        points = [points[args.only]]
    if args.device == "cuda":
        points = [Point(p.layers, p.experts, p.scale, p.rows, p.cols, p.chunk, "bf16") for p in points]
    reports = []
    for point in points:
        root = Path(tempfile.mkdtemp(prefix="calibrate-memory-", dir=args.tmp))
        try:
            reports.append(run_point(point, root, args.device, args.expert_hessians))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print_point(reports[-1])
    if args.out_json:
        args.out_json.write_text(json.dumps(reports, indent=1) + "\n")
    return reports


if __name__ == "__main__":
    main()
