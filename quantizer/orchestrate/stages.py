"""`quantizer build`: the stages in order inside one resumable work directory.

calibrate (WORK/calibration: Hessians, routing, the allocator's summary) -> plan (ours: the
allocator on that summary; uniform or exl3; or a saved plan; at a bpw or the most that fits N
Sparks) -> quantize (WORK/quantize, with the Hessians) -> pack -> verify (header level) -> publish: the
pack is renamed to --out only once verify finds it clean.
The plan is kept in WORK/plans/<pack name>/ as plan.json and recipe.yaml (exllamav3's recipe syntax),
written once the quantize stage has accepted the job: builds that share a work directory (to reuse its
calibration and encodings) keep each its own plan, and a rerun of one finds its own. Before any stage
runs, everything that can be checked is (preflight.py): the request, a given plan against the checkpoint
and its loader profile, the checkpoint against its config, places and disk. Every rank's source bytes
are pinned before the first stage and checked after each (source_guard.py), so a checkpoint changed
during the build is refused and what was made from it deleted.
With `tune` (--tune, off by default) the tune stage (WORK/tuned) fits each block's EXL3 suh/svh to the
native block's outputs on the calibration rows after quantize, and the pack takes the tuned vectors;
with `end_to_end` (--tune-e2e) every EXL3 scale of the trunk and head is then fitted to the native model's
next-token distributions (tune/end_to_end.py: small models only, refused up front where it would not fit).
Without calibration rows the linears are quantized without Hessians (uniform, exl3 or a saved plan).
Every stage resumes from its own directory, so a rerun continues where the last one stopped.
Under torchrun every rank runs build(): calibration splits the rows and quantization the units over
the ranks (quantizer/distributed.py); rank 0 plans, packs and verifies, the others wait for it.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from quantizer.orchestrate.preflight import check_given_plan, check_places, check_space, claim, disk_needs
from quantizer.orchestrate.source_guard import PinnedSource, StageOutputs, pin_source, require_unchanged
from quantizer.calibrate.needs import calibration_needs
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.stage import calibrate, tokens_digest
from quantizer.calibrate.storage import HessianStore
from quantizer.calibrate.summary import CalibrationSummary
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.fingerprint import layout_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.loader_profiles import LoaderProfile
from quantizer.contract.plan import Plan
from quantizer.distributed import code_fingerprint, current
from quantizer.errors import UserError
from quantizer.exl3 import check_bpw, rate_grid
from quantizer.fit.cold_experts import check_share, routed_tokens
from quantizer.fit.hardware import Hardware
from quantizer.fit.launch import Launch
from quantizer.fit.memory import FitReport, FitTarget
from quantizer.fit.target import choose_plan, largest_fitting_plan, largest_launch
from quantizer.inventory.classify import require_consistent
from quantizer.pack.manifest import Manifest, Planned
from quantizer.pack.writer import PackSettings, check_new_pack_dir, publish_pack, side_files, write_pack
from quantizer.plan.allocate import AllocationSettings
from quantizer.plan.methods import METHODS, OURS, UNIFORM, planner
from quantizer.plan.recipe import write_recipe
from quantizer.plan.sensitivity import synthetic_summary
from quantizer.quantize.encode_hours import RateTable, plan_estimate
from quantizer.quantize.results import measured_encodings
from quantizer.quantize.settings import QuantizeSettings
from quantizer.quantize.stage import QuantizeResult, check_cuda, measured_proxies, quantize
from quantizer.tune.end_to_end import STAGE as E2E_STAGE
from quantizer.tune.end_to_end import EndToEndResult, check_end_to_end_fits, end_to_end
from quantizer.tune.settings import EndToEndSettings, TuneSettings
from quantizer.tune.stage import STAGE as TUNE_STAGE
from quantizer.tune.stage import TuneResult, check_tune_fits, tune, tune_line
from quantizer.tune.store import finished, run_record
from quantizer.verify.checks import VerifyReport, verify_pack

QUANTIZE_DIR = "quantize"
PLANS_DIR, PLAN_FILE, RECIPE_FILE = "plans", "plan.json", "recipe.yaml"


@dataclass(frozen=True)
class BuildRequest:
    src: str
    out: Path
    bpw: float | None = None  # a plan at this rate, or
    plan: Plan | None = None  # a plan made elsewhere (quantizer plan); with either, `target` is what it is fitted to
    target: FitTarget | None = None  # alone: the most bits whose plan fits these Sparks
    method: str = OURS  # how K is chosen for bpw / target (plan/methods.py)
    allocation: AllocationSettings = field(default_factory=AllocationSettings)
    calibration_rows: torch.Tensor | None = None  # token rows [R, C]; None: no calibration, no Hessians
    calibration_settings: CalibrationSettings = CalibrationSettings()
    work: Path | None = None  # default <out>.work
    revision: str | None = None
    shard_size: int = PackSettings.shard_size
    quantize: QuantizeSettings = QuantizeSettings()
    measured: dict[str, dict[float, float]] | None = None  # ours: proxy errors per target and K, measured
    measured_from_work: bool = False  # ours: `measured` read from the work directory's cache once claimed
    plan_file: Path | None = None  # where `plan` was read from, for the messages that name it
    base_model: str | None = None  # the source's Hugging Face repo id, named in the pack's card
    command: tuple[str, ...] | None = None  # the command line, which the card gives as the way to rebuild
    tune: TuneSettings | None = None  # tune each block's EXL3 scales after quantize (needs calibration rows)
    end_to_end: EndToEndSettings | None = None  # then tune every EXL3 scale on the model's KL (small models)
    hardware: Hardware | None = None  # the memory model's hardware profile (None: the shipped GB10 one)

    @property
    def work_dir(self) -> Path:
        return self.work or self.out.with_name(self.out.name + ".work")


@dataclass(frozen=True)
class BuildResult:
    out: Path
    work: Path
    plan: Plan
    fit: FitReport | None  # the fit of the plan to req.target, when one was asked for
    calibration_summary: CalibrationSummary | None
    quantized: QuantizeResult
    tuned: TuneResult | None  # the tune stage's result, when the request asked for it
    end_to_end: EndToEndResult | None  # the end-to-end tuning's, when the request asked for it
    manifest: Manifest
    verify: VerifyReport
    seconds: float


def build(req: BuildRequest) -> BuildResult:
    """Every check that needs no stage first (request, places, the checkpoint against its config, that a
    plan can be made, disk), then the stages inside the work directory's lock (see preflight.py)."""
    start = time.monotonic()
    check_request(req)
    check_places(req.out, req.work_dir)
    check_new_pack_dir(req.out)  # before hours of work, not after
    ck = Checkpoint.open(req.src, req.revision)
    require_consistent(ck)
    if req.plan is not None:
        check_given_plan(ck, req.plan, str(req.plan_file or "--plan"))
    estimate = req.plan or check_plannable(ck.config, req)
    check_required_files(ck.root, estimate.profile)
    check_tuning_fits(ck.config, req)
    calibration_disk = 0 if req.calibration_rows is None else calibration_needs(
        ck.config, *req.calibration_rows.shape, req.calibration_settings).disk
    check_space(req.out, req.work_dir, disk_needs(ck, estimate, calibration_disk, req.work_dir))
    ranks = current()
    ranks.agree(request_record(ck, req))
    with ExitStack() as held:  # rank 0 holds the work directory and this job's partial pack directory
        partial = ranks.on_main(lambda: held.enter_context(claim(req.out, req.work_dir)))
        ranks.check_shared(req.work_dir)  # only once claimed: nothing is written into a --work before
        pin = pin_source(ck, req.work_dir)  # every rank reads the same bytes, and they stay put (source_guard.py)
        made = ranks.on_main(lambda: StageOutputs.before(req.work_dir, req.work_dir / QUANTIZE_DIR))
        if req.measured_from_work and ranks.main:  # the cache now that no other job writes into it; rank 0 plans
            req = replace(req, measured=measured_proxies(ck.config, measured_encodings(req.work_dir / QUANTIZE_DIR)))
        store, summary = None, None
        if req.calibration_rows is not None:
            summary = calibrate(ck, req.calibration_rows, req.work_dir, req.calibration_settings).summary
            require_unchanged(pin, "calibrate", made, req.work_dir)
            store = HessianStore(req.work_dir, ck)
        plan, report, launch = ranks.on_main(lambda: plan_and_state(ck.config, req, summary, ranks.world))
        settings = replace(req.quantize, hessians=store.record if store else None)
        quantized = quantize(ck, plan, req.work_dir / QUANTIZE_DIR, settings, store.hessian if store else None,
                             on_start=lambda: save_plan(ck.config, plan, req.work_dir, req.out), source_check=pin.check_read)
        require_unchanged(pin, "quantize", made, req.work_dir)
        tuned = None
        if req.tune is not None:
            tuned = ranks.on_main(lambda: tune(ck, plan, req.work_dir / QUANTIZE_DIR, req.work_dir,
                                               req.calibration_rows, req.tune, settings.record(),
                                               device=req.quantize.device))
            require_unchanged(pin, TUNE_STAGE, made, req.work_dir)
        tuned_files = tuple(tuned.files) if tuned else ()
        e2e = None
        if req.end_to_end is not None:
            e2e = ranks.on_main(lambda: end_to_end(ck, plan, req.work_dir / QUANTIZE_DIR, req.work_dir,
                                                   req.calibration_rows, req.end_to_end, settings.record(),
                                                   tuned_files, req.quantize.device))
            require_unchanged(pin, E2E_STAGE, made, req.work_dir)
        pack = PackSettings(settings.record(), req.shard_size, req.revision, req.base_model, req.command,
                            tuned_files=tuned_files + ((e2e.file,) if e2e else ()),
                            tuning=tuned.record() if tuned else None, end_to_end=e2e.record() if e2e else None,
                            launch=launch, planned=planned_of(req.target, launch))
        manifest, verified = ranks.on_main(lambda: pack_and_publish(ck, plan, req, pack, partial, pin))
        ranks.barrier()
    return BuildResult(req.out, req.work_dir, plan, report, summary, quantized, tuned, e2e, manifest, verified,
                       time.monotonic() - start)


def planned_of(target: FitTarget | None, launch: Launch) -> Planned | None:
    """What the pack records it was fitted to: the target's Sparks and streams, at the context a one-Spark pack's
    launch.env was written for (the largest that fits where no --context was given), else the target's."""
    if target is None:
        return None
    return Planned(target.sparks, launch.context or target.context, target.streams)


def check_required_files(src: Path, profile: LoaderProfile) -> None:
    """UserError, before any stage, when the source lacks a file the profile's engine reads from the pack
    directory (the pack copies it from the source): otherwise verify finds it missing after the GPU hours."""
    have = {f.name for f in side_files(src)}
    missing = [name for name in profile.required_files if name not in have]
    if missing:
        tiny = (" (a tiny checkpoint: `quantizer make-tiny --arch v41 --tokenizer` writes one)"
                if "tokenizer.json" in missing else "")
        raise UserError(f"{src}: no {', '.join(missing)}, which the {profile.name} engine reads from the pack "
                        f"directory and the pack copies from the source; add it to the source{tiny}, or choose another "
                        "--loader")


def check_tuning_fits(cfg: ModelConfig, req: BuildRequest) -> None:
    """Tuning stages run last: one that cannot fit the device is refused now rather than after the other
    stages, unless the work directory holds a finished run of it (a rerun reuses its files)."""
    rows = req.calibration_rows
    if req.tune is None and req.end_to_end is None:
        return
    digest = tokens_digest(rows)
    if req.tune is not None and not finished(req.work_dir, TUNE_STAGE, run_record(req.tune.record(), digest)):
        check_tune_fits(cfg, *rows.shape, req.tune, req.quantize.device)
    if req.end_to_end is not None and not finished(req.work_dir, E2E_STAGE, run_record(req.end_to_end.record(), digest)):
        check_end_to_end_fits(cfg, *rows.shape, req.end_to_end, req.quantize.device)


def pack_and_publish(ck: Checkpoint, plan: Plan, req: BuildRequest, settings: PackSettings, partial: Path,
                     pin: PinnedSource) -> tuple[Manifest, VerifyReport]:
    """Write the pack in `partial`, and rename it to req.out only once the source it copied from is still
    the one the build began with and verify finds it clean: a pack under its final name has passed every
    check that can refuse it, and a build killed before that leaves no pack (the rerun packs again)."""
    manifest = write_pack(ck, plan, req.work_dir / QUANTIZE_DIR, req.out, settings, partial, publish=False)
    moved = pin.moved() or ([ck.root.name] if manifest.source["fingerprint"] != pin.fingerprint else [])
    if moved:
        raise UserError(f"{ck.root}: {', '.join(moved)} changed while this build packed it; the pack was not "
                        "published. Rerun once nothing writes to the checkpoint (a source whose bytes differ from "
                        "the work directory's job is refused)")
    verified = verify_pack(partial)
    if verified.faults:
        print("\n".join(f.line() for f in verified.faults), file=sys.stderr)
        raise UserError(f"{req.out}: verify found {len(verified.faults)} fault(s) in the new pack, so it was not "
                        f"published; first: {verified.faults[0].line()}")
    publish_pack(partial, req.out)
    verified.pack = req.out
    return manifest, verified


def plan_and_state(cfg: ModelConfig, req: BuildRequest, summary: CalibrationSummary | None, ranks: int = 1
                   ) -> tuple[Plan, FitReport | None, Launch]:
    """The plan (req.plan, or chosen by req.method), its fit report and launch settings (the cold experts
    of a one-Spark target); the GPU time it implies stated (the tune stage's too, with --tune, for a job
    of `ranks` GPUs)."""
    plan, report, launch = plan_for_request(cfg, req, summary)
    if launch.context is None:  # a one-Spark pack fitted to no context: launched at the largest that fits
        launch = largest_launch(cfg, plan, req.hardware)
    table = RateTable.load(encoder=req.quantize.encoder) if req.quantize.device == "cuda" else None
    print(plan_estimate(cfg, plan, table).line(req.quantize.device), file=sys.stderr)
    if req.tune is not None:
        print(tune_line(cfg, *req.calibration_rows.shape, req.tune, (ranks,)), file=sys.stderr)
    return plan, report, launch


def check_request(req: BuildRequest) -> None:
    """UserError for a request no checkpoint could satisfy: the one place a build's request is checked
    (the command checks only which flags go together)."""
    if req.bpw is not None and req.plan is not None or (req.bpw, req.plan, req.target) == (None, None, None):
        raise UserError("give one of --bpw B, --plan PLAN.json (or --recipe) and --sparks N, or --sparks N alone")
    if req.method not in METHODS:
        raise UserError(f"--method {req.method!r}; choose from {', '.join(METHODS)}")
    if req.plan is None and req.method == OURS and req.calibration_rows is None:
        raise UserError("--method ours allocates from a calibration; drop --no-calibrate, or use --method uniform")
    if req.bpw is not None:
        check_bpw(req.bpw, req.allocation.codebook)
    if req.target is not None:
        req.allocation.profile.check_sparks(req.target.sparks)
        check_share(req.target.cold_share)
        if req.target.cold_share and req.calibration_rows is None:
            raise UserError("--cold-share picks cold experts by the calibration's routing: drop --no-calibrate")
    if req.tune is not None and req.calibration_rows is None:
        raise UserError("--tune fits the pack's scales to calibration rows; drop --no-calibrate (or drop --tune)")
    if req.end_to_end is not None and req.calibration_rows is None:
        raise UserError("--tune-e2e fits the pack's scales to calibration rows; drop --no-calibrate (or drop --tune-e2e)")
    for tuning in (req.tune, req.end_to_end):  # each needs a row to tune on and one held out
        if tuning is not None:
            tuning.split(req.calibration_rows.shape[0])
    if req.quantize.device == "cuda":  # the quantize stage's needs, not only after hours of calibration
        check_cuda()
    if (req.measured is not None or req.measured_from_work) and (req.method != OURS or req.plan is not None):
        raise UserError("--measured-errors feeds our allocator; it needs --method ours and no --plan")


def request_record(ck: Checkpoint, req: BuildRequest) -> dict:
    """What every rank of one build must agree on: inputs, settings and code (paths may differ
    between hosts; check_shared proves the work directory is the same one)."""
    rows = req.calibration_rows
    return {
        "source": layout_fingerprint(ck), "code": code_fingerprint(), "torch": torch.__version__,
        "tokens": None if rows is None else tokens_digest(rows),
        "bpw": req.bpw, "plan": None if req.plan is None else req.plan.content_hash(),
        "target": None if req.target is None else asdict(req.target), "method": req.method,
        "allocation": req.allocation.record(), "calibration": req.calibration_settings.record(),
        "quantize": req.quantize.record(), "shard_size": req.shard_size, "revision": req.revision,
        "measured": None if req.measured is None else json.dumps(req.measured, sort_keys=True),
        "measured_from_work": req.measured_from_work, "tune": None if req.tune is None else req.tune.record(),
        "hardware": None if req.hardware is None else asdict(req.hardware),
        "end_to_end": None if req.end_to_end is None else req.end_to_end.record(),
    }


def plan_files(work: Path, out: Path) -> tuple[Path, Path]:
    """(plan.json, recipe.yaml) of the build of pack `out` in `work`: under the pack's name, so builds
    sharing a work directory do not overwrite each other's."""
    folder = work / PLANS_DIR / out.name
    return folder / PLAN_FILE, folder / RECIPE_FILE


def save_plan(cfg: ModelConfig, plan: Plan, work: Path, out: Path) -> None:
    """The plan as JSON (`quantizer build --plan` takes it) and as an exllamav3 recipe.yaml; an earlier
    build's other plan for a pack of the same name is replaced with a line saying so."""
    plan_file, recipe_file = plan_files(work, out)
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    if plan_file.exists() and _saved_hash(plan_file) != plan.content_hash():
        print(f"plan: replacing {plan_file}, an earlier build's other plan for a pack named {out.name}", file=sys.stderr)
    plan.save(plan_file)
    write_recipe(cfg, plan, recipe_file, f"Plan: {plan.made_by}.\nAchieved bits (exllamav3 accounting, budgeted "
                 f"tensors): {plan.achieved_bpw:.4f}; loader {plan.profile.name}")


def _saved_hash(plan_file: Path) -> str | None:
    try:
        return json.loads(plan_file.read_text()).get("content_hash")
    except (OSError, ValueError, AttributeError):  # unreadable or not a plan: replaced like another plan
        return None


def check_plannable(cfg: ModelConfig, req: BuildRequest) -> Plan:
    """UserError, before hours of calibration, when no plan can come of the request: a --bpw below the
    method's floors (tried on a synthetic summary: the floors do not depend on calibration), or a
    --sparks target not even the lowest uniform plan fits (a plan's bytes follow from its budget).
    Returns the plan tried, whose bytes are what the calibrated plan will spend (the disk estimate)."""
    if req.bpw is not None:
        summary = synthetic_summary(cfg) if req.method == OURS else None
        return planner(cfg, req.method, req.allocation, summary)[0](req.bpw)
    plan_at, lowest = planner(cfg, UNIFORM, replace(req.allocation, alias=None))
    return largest_fitting_plan(cfg, plan_at, lowest, rate_grid(req.allocation.codebook)[-1], req.target,
                                hardware=req.hardware).plan


def plan_for_request(cfg: ModelConfig, req: BuildRequest, summary: CalibrationSummary | None
                     ) -> tuple[Plan, FitReport | None, Launch]:
    """req.plan, or the plan at req.bpw, fitted to req.target where one is given; else the largest plan that
    fits req.target, by req.method (its cold experts placed on the calibration's routing): fit/target.choose_plan,
    as `quantizer plan` chooses."""
    if req.measured is not None:
        pairs = sum(len(ks) for ks in req.measured.values())
        print(f"plan: allocating on {pairs:,} measured proxy errors of {len(req.measured):,} targets", file=sys.stderr)
    plan_at, lowest = (None, 0.0) if req.plan is not None else planner(cfg, req.method, req.allocation, summary,
                                                                         measured=req.measured)
    plan, fitted = choose_plan(cfg, plan_at, lowest, rate_grid(req.allocation.codebook)[-1], req.target, req.bpw,
                               req.plan, req.hardware, routed_tokens(summary) if summary else None)
    return (plan, fitted.report, fitted.launch) if fitted else (plan, None, Launch())