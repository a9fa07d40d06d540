"""What `quantizer fit` sizes, opened in one place: a pack (or a native checkpoint) read from its headers, a
plan file, a recipe, or a uniform plan at a bpw; with the loader profile whose engine's memory model charges
it and what the layout breaks of that profile.

Fit is a memory model first: it sizes any layout. The profile is --loader where given, else the one the
pack, plan or recipe names, else the one whose rules the layout meets among those that run the model on
the Spark count (the closest where none does). A layout that breaks the profile is still sized, as that
engine would hold its tensors, and the broken rules are reported as one finding (contract/rules.Findings);
`plan` and `build` refuse such a layout. In pack/ rather than fit/: it reads a pack's manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import LoaderProfile, default_profile
from quantizer.contract.pack_spec import ENCODED_PROBE, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import Findings, broken_rules, check_plan, for_profile, make_plan, matching_profile
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED, check_bpw
from quantizer.fit.launch import LaunchSettings, read_launch
from quantizer.fit.stored import StoredTensor, stored_from_pack
from quantizer.model.targets import stored_parts, targets
from quantizer.pack.manifest import MANIFEST_NAME, Manifest, Planned, is_pack
from quantizer.plan.recipe import plan_from_recipe, profile_note, read_recipe


@dataclass(frozen=True)
class FitInput:
    """The tensors fit sizes and the engine it charges."""

    cfg: ModelConfig
    stored: list[StoredTensor]
    profile: LoaderProfile
    source: str  # what the report names
    findings: Findings | None  # the rules of `profile` the layout breaks
    plan: Plan  # the K map (a pack's, read from its headers)
    launch: LaunchSettings | None = None  # a pack's launch.env (its CTX: the context the pack was planned for)
    packed: bool = False  # a pack quantizer wrote, not a native checkpoint, plan, recipe or bpw
    planned: Planned | None = None  # the Sparks, context and streams the pack was fitted to at build time


def open_fit_input(src: str | None, cfg: ModelConfig | None, asked: LoaderProfile | None, sparks: int,
                   plan_file: str | None = None, recipe: str | None = None, bpw: float | None = None,
                   codebook: str = "mul1", uniform: Callable[[LoaderProfile], Callable[[float], Plan]] | None = None
                   ) -> FitInput:
    """What `fit` sizes, in one call: the pack (or checkpoint) at `src` where no plan file, recipe or bpw is given;
    else that layout of the model shape `cfg`, a bpw through `uniform` (profile -> bpw -> the plan `plan` makes)."""
    if src and not (plan_file or recipe or bpw is not None):
        return pack_input(src, asked, sparks)
    if plan_file:
        return plan_input(cfg, plan_file, asked)
    if recipe:
        return recipe_input(cfg, recipe, codebook, asked, sparks)
    if bpw is None:
        raise UserError("with --model-config give --recipe R.yaml, --bpw B or --plan P.json")
    check_bpw(bpw, codebook)
    return bpw_input(cfg, uniform(asked or default_profile(cfg, sparks)), bpw)


def pack_input(path: str | Path, asked: LoaderProfile | None, sparks: int | None) -> FitInput:
    """A pack (its manifest's profile unless --loader asks for another) or a native checkpoint (the profile its
    layout meets, else the closest)."""
    manifest = Manifest.load(Path(path)) if is_pack(path) else None
    if manifest:  # its K records, launch.env and planned context size the fit: as written and true, or refused
        manifest.require_claims(Path(path) / MANIFEST_NAME)
    cfg, stored = stored_from_pack(path)
    plan = plan_of_headers(cfg, stored, manifest)
    profile = asked or (plan.profile if is_pack(path) else matching_profile(cfg, plan, sparks)[0])
    return FitInput(cfg, stored, profile, str(path), Findings.of(profile, broken_rules(cfg, plan, profile)), plan,
                    read_launch(path), manifest is not None, manifest and manifest.planned)


def plan_input(cfg: ModelConfig, path: str, asked: LoaderProfile | None) -> FitInput:
    """A plan file: charged as its own profile's engine, or --loader's."""
    plan = Plan.load(path)
    check_plan(cfg, plan, keep_rules=False)
    return _planned(cfg, for_profile(cfg, plan, asked) if asked else plan, path)


def recipe_input(cfg: ModelConfig, path: str, codebook: str, asked: LoaderProfile | None, sparks: int) -> FitInput:
    """A recipe: read for --loader, else the profile it names, else the one whose rules it meets."""
    recipe = read_recipe(path)
    plan = plan_from_recipe(cfg, recipe, codebook, asked, sparks, keep_rules=False)
    return _planned(cfg, plan, path + ("" if asked else profile_note(cfg, recipe, plan, sparks)))


def bpw_input(cfg: ModelConfig, plan_at: Callable[[float], Plan], bpw: float) -> FitInput:
    """A uniform plan at `bpw` (it keeps its profile's rules: the plan `plan --bpw` makes)."""
    return _planned(cfg, plan_at(bpw), f"uniform plan at {bpw:g} bpw")


def _planned(cfg: ModelConfig, plan: Plan, source: str) -> FitInput:
    return FitInput(cfg, list(pack_spec(cfg, plan).tensors), plan.profile, source,
                    Findings.of(plan.profile, broken_rules(cfg, plan)), plan)


def plan_of_headers(cfg: ModelConfig, stored: list[StoredTensor], manifest: Manifest | None) -> Plan:
    """The K map a pack's tensors hold (a linear is EXL3 where its trellis is stored, fp16 where the manifest
    says K 16, else in source form), as a plan of the pack's own profile (of the default profile for a native
    checkpoint): what the rules of another profile are checked against. No profile reads expert aliases, so
    a pack holds none (docs/loader-profiles.md)."""
    kept = {t.name: t for t in stored}
    fp16 = {n for n, r in manifest.tensors.items() if r.K == UNQUANTIZED} if manifest else set()
    k: dict[str, float | None] = {}
    for t in targets(cfg):
        key = stored_parts(cfg, t, ENCODED_PROBE)[0][0]
        trellis = kept.get(f"{key}.trellis")
        k[t.key] = trellis.K if trellis else UNQUANTIZED if f"{t.key}.weight" in fp16 else None
    codebook = manifest.plan["codebook"] if manifest else "mul1"
    profile = manifest.profile if manifest else default_profile(cfg)
    return make_plan(cfg, k, codebook, profile, made_by="the pack's headers", keep_rules=False)
