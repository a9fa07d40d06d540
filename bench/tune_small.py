"""What block-wise tuning (`build --tune`) and end-to-end tuning (`--tune-e2e`) give on a bundled small
model (default the V4.1 one), in our forward.

For each size: one `ours` build for the exllamav3 profile without tuning, then the same build with
tuning for each mode asked for (a block-input mode, or `e2e`: end to end from the stored scales), all in
one work directory (one calibration, one set of
encodings, so every pack holds the same codes and the same bytes). Each pack is compared with the native
model on held-out rows of each text of --eval-text (default the shipped held-out set; `heldout,heldout-tests`
adds held-out text of another kind than calibration, measured on the same packs; calibration stays the
shipped calibration set): KL, top-1 agreement, perplexity, and the ratio
tuned KL / untuned KL (the reference measured in the same run). The tune stage runs once on its own
first, so its time and peak RAM (RSS sampled every 10 ms, above the RSS before it) are its alone; the
tuned build then reuses its blocks. The RAM columns compare the stage's estimate with that peak; only
the first tune of a run measures cleanly (later ones reuse memory the allocator kept), so later rows
show no peak. With --device cuda the builds encode with exllamav3 and `e2e` runs on the GPU: its peak is
torch.cuda.max_memory_allocated above the allocation before it (every row measures cleanly). For `e2e`
the time column also gives the stage's printed estimate of its steps (its second step's time x steps)
against their measured time.

    python bench/tune_small.py                                  # 2.5 and 2.9 bpw, small settings
    python bench/tune_small.py --sizes 2.5,2.9,3.5 --calib-rows 32 --eval-rows 8 --inputs native,quantized
    python bench/tune_small.py --model small_model_v4 --sizes 2 --calib-rows 37 --cols 2048 --inputs e2e --device cuda
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantizer.orchestrate.stages import QUANTIZE_DIR, BuildRequest, build
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.plan.allocate import AllocationSettings
from quantizer.ppl.compare import compare
from quantizer.ppl.pack_source import PackSource
from quantizer.ppl.perplexity import row_predictions
from quantizer.quantize.settings import QuantizeSettings
from quantizer.report import table
from quantizer.shipped import shipped
from quantizer.textdata import SET_FILES, model_rows, shipped_text_path, text_argument
from quantizer.tune.end_to_end import end_to_end, end_to_end_needs
from quantizer.tune.settings import EndToEndSettings, TuneSettings
from quantizer.tune.stage import tune, tune_memory
from quantizer.tune.store import TunedStore


class PeakRss:
    """Peak resident memory of this process above where it stood at start, sampled every 10 ms."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def added(self) -> int:
        return self.peak - self.base


class PeakCuda:
    """Peak CUDA memory allocated above what was allocated at start."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.added = torch.cuda.max_memory_allocated() - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _streamer(source) -> LayerStreamer:
    return LayerStreamer(source, progress=False, report=lambda line: None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2.5,2.9", help="comma-separated bpw")
    ap.add_argument("--inputs", default="native,quantized",
                    help="block-input modes to tune with, comma-separated; quantized/model: quantized inputs fitted "
                         "to the native model's stream")
    ap.add_argument("--calib-rows", type=int, default=16)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--eval-rows", type=int, default=4)
    ap.add_argument("--eval-text", default="heldout",
                    help=f"comma-separated texts each pack is measured on: shipped sets ({', '.join(SET_FILES)}) or "
                         "files (default heldout)")
    ap.add_argument("--steps", type=int, default=TuneSettings.steps)
    ap.add_argument("--lr", type=float, default=TuneSettings.lr)
    ap.add_argument("--batch-rows", type=int, default=TuneSettings.batch_rows)
    ap.add_argument("--e2e-steps", type=int, default=EndToEndSettings.steps)
    ap.add_argument("--model", choices=("small_model", "small_model_v4", "small_model_v4_moe64"), default="small_model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the builds' device, and e2e's")
    ap.add_argument("--work", type=Path, help="keep the work here (default: a temporary directory)")
    args = ap.parse_args(argv)
    eval_texts = {name: text_argument(name) for name in args.eval_text.split(",")}
    ck = Checkpoint.open(shipped(args.model))
    cfg = ck.config

    def rows(text: Path, count: int) -> torch.Tensor:
        return model_rows(ck.root, cfg, text=text, rows=count, cols=args.cols, default_cols=args.cols)

    calibration = rows(shipped_text_path("calibration"), args.calib_rows)
    held = {name: rows(text, args.eval_rows) for name, text in eval_texts.items()}
    root = args.work or Path(tempfile.mkdtemp(prefix="tune-bench-"))
    reference = {name: list(row_predictions(_streamer(CheckpointSource(ck)), r)) for name, r in held.items()}

    def measured(pack: Path) -> dict:
        return {name: compare(reference[name], row_predictions(_streamer(PackSource(Checkpoint.open(pack))), r))
                for name, r in held.items()}

    out_rows, first = [], True
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            def request(name: str, tuning: TuneSettings | None, e2e: EndToEndSettings | None = None) -> BuildRequest:
                out = root / "packs" / f"{size:g}-{name}"
                shutil.rmtree(out, ignore_errors=True)
                return BuildRequest(src=str(ck.root), out=out, bpw=size, method="ours",
                                    allocation=AllocationSettings(profile=load_profile(EXLLAMAV3)), calibration_rows=calibration,
                                    calibration_settings=CalibrationSettings(device=args.device), work=root / "build",
                                    quantize=QuantizeSettings(device=args.device), tune=tuning, end_to_end=e2e)

            base = build(request("untuned", None))
            untuned = measured(base.out)
            out_rows += [[text, f"{size:g}", "-", f"{u.kl:.4f}", "1.000", f"{u.top1:.2%}", f"{u.pack.ppl:.3f}", "-", "-",
                          "-"] for text, u in untuned.items()]
            job = dict(base.manifest.settings)  # the quantize stage's record: names the units
            for mode in args.inputs.split(","):
                if mode == "e2e":
                    out_rows += _end_to_end_rows(args, ck, base, root, calibration, job, size, untuned, measured, request)
                    continue
                inputs, _, target = mode.partition("/")
                settings = TuneSettings(steps=args.steps, lr=args.lr, batch_rows=args.batch_rows, inputs=inputs,
                                        target=target or "block")
                with PeakRss() as rss:
                    t0 = time.monotonic()
                    result = tune(ck, base.plan, root / "build" / QUANTIZE_DIR, root / "build", calibration, settings, job)
                    seconds = time.monotonic() - t0
                estimate = tune_memory(cfg, *calibration.shape, settings)
                store = TunedStore(root / "build")
                steps = sum(store.info(p)["steps"] for p in result.files)
                tuned = build(request(f"tuned-{mode}", settings))
                if [s.bytes for s in tuned.manifest.shards] != [s.bytes for s in base.manifest.shards]:
                    raise SystemExit(f"{size:g} bpw: the tuned pack's shards differ in size from the untuned pack's")
                for text, c in measured(tuned.out).items():
                    out_rows.append([text, f"{size:g}", mode, f"{c.kl:.4f}", f"{c.kl / untuned[text].kl:.3f}",
                                     f"{c.top1:.2%}", f"{c.pack.ppl:.3f}", f"{seconds:.0f} s ({steps} steps)",
                                     f"{estimate / 2**20:.0f} / {rss.added / 2**20:.0f} MiB" if first else "-",
                                     f"{estimate / max(rss.added, 1):.2f}" if first else "-"])
                    print(f"{size:g} {mode} on {text}: KL {untuned[text].kl:.4f} -> {c.kl:.4f}", file=sys.stderr, flush=True)
                first = False
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)
    native = {name: float(torch.cat([r.nll() for r in ref]).mean().exp()) for name, ref in reference.items()}
    print(f"{args.model}, ours for exllamav3, our forward; {args.calib_rows} calibration rows x {args.cols} tokens "
          f"(tuning and held-out split by the tune stage), {args.eval_rows} held-out eval rows per text; native ppl "
          + ", ".join(f"{v:.3f} on {k}" for k, v in native.items()))
    out_rows.sort(key=lambda r: list(held).index(r[0]))  # one text's rows together, in the order run
    print(table(["eval text", "bpw", "tuned inputs", "KL", "KL / untuned", "top-1", "ppl", "tune time", "RAM est / peak",
                 "est / peak"], out_rows))


def _end_to_end_rows(args, ck, base, root: Path, calibration: torch.Tensor, job: dict, size: float, untuned: dict,
                     measured, request) -> list[list[str]]:
    """End-to-end tuning from the stored scales: its peak memory and step time against what it states, and
    the tuned pack measured like the others."""
    settings = EndToEndSettings(steps=args.e2e_steps)
    lines: list[str] = []
    meter = PeakCuda() if args.device == "cuda" else PeakRss()
    with meter:
        result = end_to_end(ck, base.plan, root / "build" / QUANTIZE_DIR, root / "build", calibration, settings, job,
                            device=args.device, say=lambda line: (lines.append(line), print(line, file=sys.stderr)))
    estimate = end_to_end_needs(ck.config, *calibration.shape, settings)
    per_step = next(float(m[1]) for line in lines if (m := re.search(r"([\d.]+) s per step", line)))
    step_seconds = TunedStore(root / "build").info(result.file)["step_seconds"]
    tuned = build(request("tuned-e2e", None, settings))
    rows = []
    for text, c in measured(tuned.out).items():
        rows.append([text, f"{size:g}", "e2e", f"{c.kl:.4f}", f"{c.kl / untuned[text].kl:.3f}", f"{c.top1:.2%}",
                     f"{c.pack.ppl:.3f}", f"{result.seconds:.0f} s ({result.steps} steps; steps est "
                     f"{per_step * result.steps:.1f} / {step_seconds:.1f} s)",
                     f"{estimate / 2**20:.0f} / {meter.added / 2**20:.0f} MiB", f"{estimate / max(meter.added, 1):.2f}"])
        print(f"{size:g} e2e on {text}: KL {untuned[text].kl:.4f} -> {c.kl:.4f}", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    main()
