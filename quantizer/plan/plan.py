"""The plan: what K every EXL3 target gets, which cold experts alias warm ones, and the bytes that
follow. It is the contract between planning (uniform or allocator) and the quantize/pack stages.

K None means the tensor keeps its native storage; 16 means an unquantized fp16 linear. A plan is
made for one loader profile (profiles.py): `exllamav3` (stock exllamav3 1.6.5: one K per projection
per layer, gate and up tied), `vllm-exl3` (routed experts EXL3 with K per expert, the rest in source
form) or `tensorfold` (every linear EXL3 mul1); `make_plan` refuses a plan that breaks its profile's
rules.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.exl3 import CODEBOOKS, budget_bpw, check_k
from quantizer.model.targets import DRAFT, ROUTED, target_map, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE
from quantizer.plan.profiles import EXLLAMAV3, load_profile, violations
from quantizer.plan.spec import aliased_keys, expert_of, spec_bytes, stored_linears
from quantizer.workdir import read_json, write_json_atomic

FORMAT = "quantizer-plan"
VERSION = 2  # 2: `loader` (a profile name) replaces `mode`
TOTAL = "total"
TOTAL_RESIDENT = "total_without_engram_tables"


@dataclass
class Plan:
    arch: str
    codebook: str
    loader: str  # the loader profile the plan satisfies (profiles.py)
    k: dict[str, float | None]  # every EXL3 target key of the model -> K, or None = native
    target_bpw: float | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # cold expert -> warm expert of its layer
    expected_bytes: dict[str, int] = field(default_factory=dict)  # per tensor class, plus totals
    achieved_bpw: float = 0.0  # exllamav3's `bits`: sum(numel*K)/sum(numel) over budgeted targets
    made_by: str = ""

    @property
    def head_bits(self) -> float | None:
        return self.k.get("head")

    def content_hash(self) -> str:
        """sha256 of what decides the pack's tensors: K map, aliases, codebook, loader, arch."""
        body = {"arch": self.arch, "codebook": self.codebook, "loader": self.loader,
                "k": self.k, "aliases": self.aliases}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # ---- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "arch": self.arch, "codebook": self.codebook,
            "loader": self.loader, "target_bpw": self.target_bpw, "achieved_bpw": self.achieved_bpw,
            "head_bits": self.head_bits, "made_by": self.made_by, "content_hash": self.content_hash(),
            "expected_bytes": self.expected_bytes, "aliases": self.aliases, "k": self.k,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp name, then rename)."""
        path = Path(path)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        data = read_json(path, "plan file not found", "write it again with `quantizer plan`")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(f"{path}: not a quantizer plan (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise UserError(f"{path}: plan version {data.get('version')}; this quantizer reads version {VERSION}")
        try:
            plan = cls(
                arch=data["arch"], codebook=data["codebook"], loader=data["loader"],
                k={key: (None if v is None else float(v)) for key, v in data["k"].items()},
                target_bpw=data.get("target_bpw"), aliases=dict(data.get("aliases") or {}),
                expected_bytes={c: int(n) for c, n in (data.get("expected_bytes") or {}).items()},
                achieved_bpw=float(data.get("achieved_bpw", 0.0)), made_by=data.get("made_by", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: malformed plan ({e}); write it again with `quantizer plan`")
        stored = data.get("content_hash")
        if stored and stored != plan.content_hash():
            raise UserError(f"{path}: content_hash does not match the K map (edited by hand?); "
                            "delete the content_hash field to accept the edit")
        return plan


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
    plan = Plan(cfg.arch, codebook, loader, k, target_bpw, dict(aliases or {}), made_by=made_by)
    check_plan(cfg, plan)
    plan.expected_bytes = expected_bytes(cfg, plan)
    plan.achieved_bpw = achieved_bpw(cfg, plan)
    return plan


def check_plan(cfg: ModelConfig, plan: Plan) -> None:
    """Every target has a K it may take, aliases point cold experts at warm experts of the same
    layer, and the plan keeps every rule of its loader profile. UserError names the first problem."""
    if plan.codebook not in CODEBOOKS:
        raise UserError(f"plan codebook {plan.codebook!r}; choose one of {', '.join(CODEBOOKS)}")
    profile = load_profile(plan.loader)
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
    """exllamav3's `bits` over the targets the plan's loader budgets (profiles.py: for vllm-exl3 the
    routed experts only); a native target counts at its source precision, an aliased cold expert at 0
    (it stores nothing)."""
    cold = aliased_keys(plan)
    profile = load_profile(plan.loader)
    return budget_bpw([
        (t.numel, 0.0 if t.key in cold else plan.k[t.key] if plan.k[t.key] is not None
         else 8 * t.native_bytes / t.numel)
        for t in targets(cfg) if profile.budgets(t)
    ])
