"""The rules a plan keeps and the bytes it implies: `make_plan` checks a K map against the model and its
loader profile and prices it from the pack spec, so every plan a stage receives is one its engine loads.

`fit` answers for any layout, so it makes plans that keep only the model's own rules (`keep_rules=False`)
and reports what a layout breaks of a profile as `Findings`; `matching_profile` names the profile whose
rules a layout meets (or the closest one) among those that run a model on a Spark count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import LoaderProfile, Violation, profiles_for, stock_profile, violations
from quantizer.contract.pack_spec import aliased_keys, expert_of, spec_bytes, stored_linears
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import CODEBOOKS, budget_bpw, check_k
from quantizer.model.targets import DRAFT, ROUTED, target_map, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE

TOTAL = "total"
TOTAL_RESIDENT = "total_without_engram_tables"


def make_plan(
    cfg: ModelConfig,
    k: dict[str, float | None],
    codebook: str = "mul1",
    profile: LoaderProfile | None = None,
    target_bpw: float | None = None,
    aliases: dict[str, str] | None = None,
    made_by: str = "",
    keep_rules: bool = True,
) -> Plan:
    """A checked plan with its expected bytes; every target of `cfg` must have an entry in `k`. With
    `keep_rules` False the loader profile's rules are not enforced (what `fit` sizes: broken_rules says
    which it breaks). `profile` None: stock exllamav3."""
    k = {key: (None if v is None else float(v)) for key, v in k.items()}
    plan = Plan(cfg.arch, codebook, profile or stock_profile(), k, target_bpw, dict(aliases or {}), made_by=made_by)
    check_plan(cfg, plan, keep_rules)
    return priced(cfg, plan)


def priced(cfg: ModelConfig, plan: Plan) -> Plan:
    """The plan with its expected bytes and achieved bpw (both depend on its loader profile)."""
    plan.expected_bytes = expected_bytes(cfg, plan)
    plan.achieved_bpw = achieved_bpw(cfg, plan)
    return plan


def check_plan(cfg: ModelConfig, plan: Plan, keep_rules: bool = True) -> None:
    """Every target has a K it may take, aliases point cold experts at warm experts of the same
    layer, and (with `keep_rules`) the plan keeps every rule of its loader profile. UserError names the
    first problem."""
    if plan.codebook not in CODEBOOKS:
        raise UserError(f"plan codebook {plan.codebook!r}; choose one of {', '.join(CODEBOOKS)}")
    profile = plan.profile
    if plan.arch != cfg.arch:
        raise UserError(f"plan is for arch {plan.arch}, the model is {cfg.arch}")
    profile.check_arch(cfg)
    tmap = target_map(cfg)
    unknown = sorted(set(plan.k) - set(tmap))
    if unknown:
        raise UserError(f"plan names {len(unknown)} tensor(s) the model has no EXL3 target for, e.g. {unknown[0]}")
    missing = [key for key in tmap if key not in plan.k]
    if missing:
        raise UserError(f"plan has no K for {len(missing)} target(s), e.g. {missing[0]}")
    checked = set()  # a K is checked once per (K, integer_only): ~96k targets share a dozen of them
    for key, value in plan.k.items():
        if value is not None and (value, tmap[key].integer_only) not in checked:
            check_k(value, plan.codebook, tmap[key].integer_only, key)
            checked.add((value, tmap[key].integer_only))
    _check_aliases(cfg, plan)
    if not keep_rules:
        return
    broken = broken_rules(cfg, plan)
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        raise UserError(f"plan breaks the {profile.name} loader profile: {broken[0].line(profile)}{more}"
                        f"{_other_profile_hint(cfg, plan)}")


def broken_rules(cfg: ModelConfig, plan: Plan, profile: LoaderProfile | None = None) -> list[Violation]:
    """Every rule of `profile` (default: the plan's own) that the plan's layout breaks."""
    return violations(profile or plan.profile, stored_linears(cfg, plan), plan.aliases)


@dataclass(frozen=True)
class Findings:
    """What a layout breaks of one loader profile: fit states it and sizes the layout all the same."""

    profile: str
    count: int
    by_rule: dict[str, int]
    first: str  # the first broken rule: the stored key (or layer) and what is wrong

    @classmethod
    def of(cls, profile: LoaderProfile, broken: list[Violation]) -> "Findings | None":
        if not broken:
            return None
        first = broken[0]
        return cls(profile.name, len(broken), dict(Counter(v.rule for v in broken).most_common()),
                   f"{first.subject}: {first.detail}")

    def line(self) -> str:
        rules = ", ".join(f"{rule} {n:,}" for rule, n in self.by_rule.items())
        return (f"finding: the layout breaks {self.count:,} rule(s) of the {self.profile} loader profile ({rules}); "
                f"first: {self.first}. `plan` and `build` refuse it for {self.profile}; the memory is counted as that "
                "engine would hold the tensors")


def matching_profile(cfg: ModelConfig, plan: Plan, sparks: int | None = None) -> tuple[LoaderProfile, list[Violation]]:
    """The profile whose rules the plan's layout meets among those that run the model on `sparks` Sparks (the
    default profile first), else the one it breaks fewest rules of, with what it breaks."""
    best: tuple[LoaderProfile, list[Violation]] | None = None
    linears = stored_linears(cfg, plan)
    for profile in profiles_for(cfg, sparks):
        broken = violations(profile, linears, plan.aliases)
        if not broken:
            return profile, []
        if best is None or len(broken) < len(best[1]):
            best = (profile, broken)
    return best


def for_profile(cfg: ModelConfig, plan: Plan, profile: LoaderProfile) -> Plan:
    """The same K map laid out for another profile (its plain dtypes and Engram place decide the bytes)."""
    return plan if plan.profile == profile else priced(cfg, replace(plan, profile=profile))


def _other_profile_hint(cfg: ModelConfig, plan: Plan) -> str:
    """A profile that takes the layout as it is, where one does."""
    fits = [p.name for p in profiles_for(cfg) if p != plan.profile and not broken_rules(cfg, plan, p)]
    return f"; the {fits[0]} profile takes it as it is (--loader {fits[0]})" if fits else ""


def _check_aliases(cfg: ModelConfig, plan: Plan) -> None:
    experts = {expert_of(t.key): t for t in targets(cfg) if t.group in (ROUTED, DRAFT) and t.expert is not None}
    for cold, warm in plan.aliases.items():
        for e in (cold, warm):
            if e not in experts:
                raise UserError(f"alias {cold} -> {warm}: {e} is not a routed expert of this model")
        if cold.split(".ffn.")[0] != warm.split(".ffn.")[0]:
            raise UserError(f"alias {cold} -> {warm}: a cold expert must alias an expert of the same layer")
        if warm in plan.aliases:
            raise UserError(f"alias {cold} -> {warm}: {warm} is itself aliased; point at a stored expert")


def expected_bytes(cfg: ModelConfig, plan: Plan) -> dict[str, int]:
    """Stored bytes per tensor class if the plan is packed, with totals (Engram tables included
    in `total`, left out of `total_without_engram_tables`, since they normally stay on NVMe)."""
    out = spec_bytes(cfg, plan)
    out[TOTAL] = sum(out.values())
    out[TOTAL_RESIDENT] = out[TOTAL] - out.get(ENGRAM_TABLE, 0)
    return out


def achieved_bpw(cfg: ModelConfig, plan: Plan) -> float:
    """exllamav3's `bits` over the targets the plan's loader budgets (loader_profiles.py: for vllm-exl3 the
    routed experts only); a native target counts at its source precision, an aliased cold expert at 0
    (it stores nothing)."""
    cold = aliased_keys(plan)
    profile = plan.profile
    return budget_bpw([
        (t.numel, 0.0 if t.key in cold else plan.k[t.key] if plan.k[t.key] is not None
         else 8 * t.native_bytes / t.numel)
        for t in targets(cfg) if profile.budgets(t)
    ])
