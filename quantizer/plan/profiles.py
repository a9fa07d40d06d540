"""Loader profiles: the constraints an engine puts on the EXL3 tensors of a pack, read from
`configs/loaders/<name>.json` (each rule with the engine source it comes from; docs/loader-profiles.md).

The allocator optimises inside a profile (allocate.py), `make_plan` refuses a plan that breaks it,
and `quantizer verify --loader` checks a written pack against it. The rules are checked on the
stored linears, each with its K (None: native storage, 16: fp16) and codebook:

- `codebook`: quantized linears use a codebook the engine's kernels decode;
- `k_range`: quantized K within [k_min, k_max] (16 = fp16 where `fp16_linears`);
- `half_rates`: half-integer K only with `half_rate_codebooks`;
- `integer_attention`: DSV4 attention, compressor and indexer linears take integer K;
- `one_k_per_projection`: the routed experts of one layer share one K per projection;
- `gate_up_tied`: gate (w1) and up (w3) of a layer's routed experts share one K;
- `aliases`: whether cold experts may be served by another expert's tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.targets import DRAFT, ROUTED, Target
from quantizer.plan.spec import StoredLinear
from quantizer.shipped import shipped

EXLLAMAV3 = "exllamav3"
MIXEDK = "mixedk"
LOADERS = (EXLLAMAV3, MIXEDK)
RULES = ("codebook", "k_range", "half_rates", "integer_attention", "one_k_per_projection", "gate_up_tied", "aliases")


@dataclass(frozen=True)
class LoaderProfile:
    name: str
    engine: str
    codebooks: tuple[str, ...]
    k_min: float
    k_max: float
    fp16_linears: bool
    half_rate_codebooks: tuple[str, ...]
    integer_attention: bool
    per_expert_k: bool
    tie_gate_up: bool
    aliases: bool
    sources: dict[str, str]

    def integer_only(self, t: Target) -> bool:
        return self.integer_attention and t.integer_only

    def allows_k(self, k: float, codebook: str, t: Target) -> bool:
        """Whether one linear of target `t` may hold K `k` under this profile (a unit's own rule)."""
        if k == UNQUANTIZED:
            return self.fp16_linears
        half = k != int(k)
        return (codebook in self.codebooks and self.k_min <= k <= self.k_max
                and not (half and (codebook not in self.half_rate_codebooks or self.integer_only(t))))


@lru_cache(maxsize=None)
def load_profile(name: str) -> LoaderProfile:
    if name not in LOADERS:
        raise UserError(f"loader profile {name!r}; choose one of {', '.join(LOADERS)}")
    data = json.loads(shipped("configs", "loaders", f"{name}.json").read_text())
    return LoaderProfile(
        name=data["name"], engine=data["engine"], codebooks=tuple(data["codebooks"]),
        k_min=float(data["k_min"]), k_max=float(data["k_max"]), fp16_linears=bool(data["fp16_linears"]),
        half_rate_codebooks=tuple(data["half_rate_codebooks"]), integer_attention=bool(data["integer_attention"]),
        per_expert_k=bool(data["per_expert_k"]), tie_gate_up=bool(data["tie_gate_up"]),
        aliases=bool(data["aliases"]), sources=dict(data["sources"]),
    )


@dataclass(frozen=True)
class Violation:
    subject: str  # the stored key, or the layer's experts for a grouped rule
    rule: str
    detail: str

    def reason(self, profile: LoaderProfile) -> str:
        return f"{self.detail} (loader {profile.name}, rule {self.rule}: {profile.sources[self.rule]})"

    def line(self, profile: LoaderProfile) -> str:
        return f"{self.subject}: {self.reason(profile)}"


def violations(profile: LoaderProfile, linears: list[StoredLinear], aliases: dict[str, str]) -> list[Violation]:
    """Every rule of `profile` that `linears` (aliased experts left out) and `aliases` break."""
    found: list[Violation] = []
    for s in linears:
        if s.K is None or s.K == UNQUANTIZED:
            if s.K == UNQUANTIZED and not profile.fp16_linears:
                found.append(Violation(s.key, "k_range", "fp16 linear (K 16), which this loader does not take"))
            continue
        if s.codebook not in profile.codebooks:
            found.append(Violation(s.key, "codebook", f"codebook {s.codebook}; this loader takes "
                                                      f"{' or '.join(profile.codebooks)}"))
        if not profile.k_min <= s.K <= profile.k_max:
            found.append(Violation(s.key, "k_range", f"K {s.K:g} outside {profile.k_min:g}..{profile.k_max:g}"))
        if s.K != int(s.K):
            if profile.integer_only(s.target):
                found.append(Violation(s.key, "integer_attention", f"half-integer K {s.K:g} on a DSV4 attention linear"))
            elif s.codebook not in profile.half_rate_codebooks:
                found.append(Violation(s.key, "half_rates", f"half-integer K {s.K:g} with codebook {s.codebook}"))
    experts = [s for s in linears if s.target.group in (ROUTED, DRAFT) and s.target.expert is not None]
    if not profile.per_expert_k:
        found += _one_k(experts, lambda s: (s.target.group, s.target.layer, s.target.proj), "one_k_per_projection")
    if profile.tie_gate_up:
        gate_up = [s for s in experts if s.target.proj in ("w1", "w3")]
        key = (lambda s: (s.target.group, s.target.layer)) if not profile.per_expert_k else \
            (lambda s: (s.target.group, s.target.layer, s.target.expert))
        found += _one_k(gate_up, key, "gate_up_tied")
    if aliases and not profile.aliases:
        found += [Violation(cold, "aliases", f"aliased to {warm}; this loader reads every expert's own tensors")
                  for cold, warm in sorted(aliases.items())]
    return found


def _one_k(linears: list[StoredLinear], unit, rule: str) -> list[Violation]:
    """One Violation per unit whose linears hold more than one K, naming the first two that differ."""
    first: dict[tuple, StoredLinear] = {}
    bad: dict[tuple, Violation] = {}
    for s in linears:
        u = unit(s)
        f = first.setdefault(u, s)
        if s.K != f.K and u not in bad:
            what = "gate (w1) and up (w3)" if rule == "gate_up_tied" else "experts of one projection"
            bad[u] = Violation(_layer_of(s), rule, f"{what} must share one K: {f.key} has {_show(f.K)}, "
                                                   f"{s.key} has {_show(s.K)}")
    return list(bad.values())


def _layer_of(s: StoredLinear) -> str:
    return s.key.split(".experts.")[0] + ".experts"


def _show(k: float | None) -> str:
    return "native" if k is None else f"K {k:g}"
