"""What a build of a plan costs on one GPU, before anyone rents one: hours, peak memory and disk of each
stage, the GPU to rent, and whether a DGX Spark can run the build itself.

Every figure is the estimate the stage itself states before it starts (calibrate/needs.py,
quantize/stage.py, quantize/encode_hours.py, orchestrate/preflight.py), at the defaults of `build`:
250 x 2048 calibration rows, gate2 expert Hessians, our encoder on CUDA. Calibration hours come from the
full-size layer measured in configs/hardware/build_gpus.json, scaled by model FLOPs (model/flops.py);
the pack stage is a disk-speed copy with no measured rate, and says so. docs/guide.md (What a build
costs) explains each line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantizer.caches import process_cache
from quantizer.calibrate.needs import calibration_needs
from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS, CalibrationSettings
from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.pack_spec import native_tensors, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import TOTAL, TOTAL_RESIDENT
from quantizer.errors import UserError
from quantizer.fit.hardware import load_hardware
from quantizer.model.flops import model_flops
from quantizer.orchestrate.preflight import JSON_BYTES, TENSOR_OVERHEAD
from quantizer.quantize.encode_hours import RateTable, plan_estimate
from quantizer.quantize.linears import plan_units
from quantizer.quantize.pipeline import PREFETCH_UNITS
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import quantize_disk, quantize_gpu_memory, quantize_ram
from quantizer.report import GIB
from quantizer.shipped import model_config_path, shipped

GPUS_FORMAT = "quantizer-build-gpus"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes torch sees


@dataclass(frozen=True)
class StagePrice:
    hours: float | None  # None: no measured rate
    gpu: int  # peak GPU memory, bytes
    ram: int  # peak host memory, bytes
    disk: int  # what the stage keeps on disk at its peak, bytes

    def to_dict(self) -> dict:
        return {"hours": self.hours, "gpu_gib": self.gpu / GIB, "ram_gib": self.ram / GIB, "disk_gib": self.disk / GIB}


@dataclass(frozen=True)
class BuildPrice:
    calibrate: StagePrice
    quantize: StagePrice
    hessians: int  # the calibration's files the quantize stage reads (its resume point is gone by then)
    pack: int  # bytes the pack writes, its Engram tables included (docs/guide.md: linked only where a source shard
    # holds nothing else, which DeepSeek's shards do not)
    tables: int  # of which the Engram tables
    source: int  # the checkpoint's bytes
    calibrate_gpu: str  # the GPU the calibration hours were measured on
    quantize_gpu: str  # the GPU of the encode rates
    rent: Gpu | None  # the smallest known GPU the whole build fits; None: none does
    spark_usable: int  # a GB10's memory left for the build (visible less OS reserve and guard), bytes

    @property
    def hours(self) -> float:
        return (self.calibrate.hours or 0.0) + (self.quantize.hours or 0.0)

    @property
    def disk(self) -> int:
        """Peak disk: the source, with the calibration at its own peak or, later, its Hessians, the quantized
        results and the pack together (the work directory is kept until the pack is verified)."""
        later = self.hessians + self.quantize.disk + self.pack
        return self.source + max(self.calibrate.disk, later)

    def spark_verdict(self) -> str:
        """Whether one Spark can run the build: its GPU and host memory are one pool (docs/gb10-memory.md)."""
        stages = {"calibrate": self.calibrate, "quantize": self.quantize}
        need = {name: s.gpu + s.ram for name, s in stages.items()}
        short = [f"{name} needs {_g(n)} GiB of GPU memory and RAM together, a Spark has {_g(self.spark_usable)} GiB "
                 "for it" for name, n in need.items() if n > self.spark_usable]
        held = [f"{name} fits ({_g(n)} GiB)" for name, n in need.items() if n <= self.spark_usable]
        if short:
            return "no: " + "; ".join(short + [f"{h}, but no rate is measured on GB10" for h in held])
        return (f"its memory holds every stage (at most {_g(max(need.values()))} of {_g(self.spark_usable)} GiB), but "
                "no rate is measured on GB10, so no hours")

    def to_dict(self) -> dict:
        """`plan --json`'s "price": GiB and hours as the lines print them."""
        return {"calibrate": self.calibrate.to_dict() | {"gpu": self.calibrate_gpu},
                "quantize": self.quantize.to_dict() | {"gpu": self.quantize_gpu}, "pack_gib": self.pack / GIB,
                "gpu_hours": self.hours, "disk_gib": self.disk / GIB, "rent": self.rent.name if self.rent else None,
                "spark": self.spark_verdict()}

    def lines(self) -> list[str]:
        c, q = self.calibrate, self.quantize
        rent = (f"one {self.rent.name} ({_g(self.rent.memory)} GiB): the build peaks at {_g(max(c.gpu, q.gpu))} GiB"
                if self.rent else f"none of the known GPUs holds the calibration's {_g(c.gpu)} GiB: spread it over "
                "torchrun ranks (docs/guide.md, On several GPUs and hosts)")
        return [
            f"build price, one GPU at build's defaults ({DEFAULT_ROWS} x {DEFAULT_COLS:,} calibration rows, "
            "docs/guide.md#what-a-build-costs):",
            f"  GPU to rent   {rent}",
            f"  calibrate     {_hours(c.hours)} on one {self.calibrate_gpu}; peak {_g(c.gpu)} GiB GPU memory, "
            f"{_g(c.ram)} GiB RAM, {_g(c.disk)} GiB disk",
            f"  quantize      {_hours(q.hours)} on one {self.quantize_gpu}; peak {_g(q.gpu)} GiB GPU memory, "
            f"{_g(q.ram)} GiB RAM, {_g(q.disk)} GiB disk",
            f"  pack          writes {_g(self.pack)} GiB, {_g(self.tables)} of them the Engram tables (linked instead where "
            "a source shard holds nothing else); a disk-speed copy, no measured rate",
            f"  in all        ~{self.hours:.1f} GPU-hours (each stage's on the GPU its rate was measured on); disk at "
            f"the peak {_g(self.disk)} GiB (source {_g(self.source)} + calibration, results and pack)",
            f"  on a Spark    {self.spark_verdict()}",
        ]


def _g(n: int) -> str:
    return f"{n / GIB:,.1f}"


def _hours(hours: float | None) -> str:
    if hours is None:
        return "no measured rate"
    return f"~{hours:.1f} h" if hours >= 0.05 else "under 0.1 h"


def build_price(cfg: ModelConfig, plan: Plan) -> BuildPrice:
    gpus, layer_rate = _build_gpus()
    calibration = CalibrationSettings(device="cuda")
    calibrate, hessians = _calibrate_price(cfg, layer_rate)
    spec = pack_spec(cfg, plan)
    by_key = {s.key: s for s in spec.encoded}
    units = plan_units(spec, plan.codebook, QuantizeSettings(device="cuda").record())
    table = RateTable.load()
    quantize = StagePrice(plan_estimate(cfg, plan, table).gpu_hours,
                          quantize_gpu_memory(units, by_key, PREFETCH_UNITS, calibration.expert_inputs),
                          quantize_ram(units, by_key, PREFETCH_UNITS, "cuda", calibration.expert_inputs),
                          quantize_disk(units, by_key, plan.codebook))
    pack = plan.expected_bytes[TOTAL] + TENSOR_OVERHEAD * len(spec.tensors) + JSON_BYTES
    tables = plan.expected_bytes[TOTAL] - plan.expected_bytes[TOTAL_RESIDENT]
    peak = max(calibrate.gpu, quantize.gpu)
    rent = next((g for g in sorted(gpus, key=lambda g: g.memory) if g.memory >= peak), None)
    hw = load_hardware()
    usable = int((hw.visible(0) - hw.os_reserve_gib.value - hw.guard_gib.value) * GIB)
    return BuildPrice(calibrate, quantize, hessians, pack, tables, sum(n.nbytes for n in native_tensors(cfg)), layer_rate.gpu,
                      table.device.removeprefix("NVIDIA "), rent, usable)


@process_cache(maxsize=2)
def _calibrate_price(cfg: ModelConfig, layer_rate: "_LayerRate") -> tuple[StagePrice, int]:
    """The calibration's price and the Hessian bytes it leaves: the same for every plan of a model (fit
    searches and the README's rows ask for many)."""
    cal = calibration_needs(cfg, DEFAULT_ROWS, DEFAULT_COLS, CalibrationSettings(device="cuda"))
    return StagePrice(layer_rate.hours(cfg), cal.device, cal.ram("cuda"), cal.disk), cal.layer_files


@dataclass(frozen=True)
class _LayerRate:
    """The calibration of one full-size layer, measured: seconds at rows x cols on `gpu`."""
    gpu: str
    model: str
    seconds_per_layer: float
    rows: int
    cols: int

    def hours(self, cfg: ModelConfig) -> float:
        measured = ModelConfig.from_file(model_config_path(self.model + ".json"))
        per_flop = self.seconds_per_layer * measured.num_layers / model_flops(measured, self.rows, self.cols)
        return model_flops(cfg, DEFAULT_ROWS, DEFAULT_COLS) * per_flop / 3600


def _build_gpus() -> tuple[list[Gpu], _LayerRate]:
    path = shipped("configs", "hardware", "build_gpus.json")
    try:
        data = json.loads(path.read_text())
        gpus = [Gpu(g["name"], int(float(g["memory_gib"]) * GIB)) for g in data["gpus"]]
        c = data["calibration"]
        rate = _LayerRate(c["gpu"], c["model"], float(c["seconds_per_layer"]), int(c["rows"]), int(c["cols"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a readable {GPUS_FORMAT} table ({e})") from None
    if data.get("format") != GPUS_FORMAT:
        raise UserError(f"{path}: not a {GPUS_FORMAT} table")
    return gpus, rate
