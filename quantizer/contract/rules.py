"""The rules a plan keeps and the bytes it implies: `make_plan` checks a K map against the model and its
loader profile and prices it from the pack spec, so every plan a stage receives is one its engine loads.
"""

from __future__ import annotations

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile, violations
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
    loader: str = EXLLAMAV3,
    target_bpw: float | None = None,
    aliases: dict[str, str] | None = None,
    made_by: str = "",
) -> Plan:
    """A checked plan with its expected bytes; every target of `cfg` must have an entry in `k`."""
    k = {key: (None if v is None else float(v)) for key, v in k.items()}
    plan = Plan(cfg.arch, codebook, load_profile(loader), k, target_bpw, dict(aliases or {}), made_by=made_by)
    check_plan(cfg, plan)
    plan.expected_bytes = expected_bytes(cfg, plan)
    plan.achieved_bpw = achieved_bpw(cfg, plan)
    return plan


def check_plan(cfg: ModelConfig, plan: Plan) -> None:
    """Every target has a K it may take, aliases point cold experts at warm experts of the same
    layer, and the plan keeps every rule of its loader profile. UserError names the first problem."""
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
    broken = violations(profile, stored_linears(cfg, plan), plan.aliases)
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        raise UserError(f"plan breaks the {profile.name} loader profile: {broken[0].line(profile)}{more}")


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
