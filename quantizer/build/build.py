"""`quantizer build`: the stages in order inside one resumable work directory.

plan (uniform at --bpw, or a saved plan) -> quantize -> pack -> verify (header level) -> summary.
Calibration and the allocator will slot in before quantize; each stage stays one call here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.pack.manifest import Manifest
from quantizer.pack.writer import PackSettings, check_new_pack_dir, write_pack
from quantizer.plan.plan import Plan
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import QuantizeResult, quantize
from quantizer.verify.verify import VerifyReport, verify_pack


@dataclass(frozen=True)
class BuildRequest:
    src: str
    out: Path
    bpw: float | None = None  # a uniform plan at this rate, or
    plan: Plan | None = None  # a plan made elsewhere (quantizer plan, the allocator)
    work: Path | None = None  # default <out>.work
    codebook: str = "mul1"  # for the uniform plan
    revision: str | None = None
    shard_size: int = PackSettings.shard_size
    quantize: QuantizeSettings = QuantizeSettings()

    @property
    def work_dir(self) -> Path:
        return self.work or self.out.with_name(self.out.name + ".work")


@dataclass(frozen=True)
class BuildResult:
    out: Path
    plan: Plan
    quantized: QuantizeResult
    manifest: Manifest
    verify: VerifyReport
    seconds: float


def build(req: BuildRequest) -> BuildResult:
    start = time.monotonic()
    if (req.bpw is None) == (req.plan is None):
        raise UserError("give either --bpw (a uniform plan) or --plan PLAN.json")
    check_new_pack_dir(req.out)  # before hours of quantizing, not after
    ck = Checkpoint.open(req.src, req.revision)
    plan = req.plan or uniform_plan(ck.config, req.bpw, codebook=req.codebook)
    quantized = quantize(ck, plan, req.work_dir, req.quantize)
    manifest = write_pack(ck, plan, req.work_dir, req.out, PackSettings(req.shard_size, req.revision, req.quantize.record()))
    report = verify_pack(req.out)
    return BuildResult(req.out, plan, quantized, manifest, report, time.monotonic() - start)
