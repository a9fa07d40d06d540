"""A plan in a few lines a person reads: K per tensor group, routed experts per layer, aliases, bits and
the bytes per tensor class. `plan` and `build` print it; the plan file holds the whole K map."""

from __future__ import annotations

from collections import Counter, defaultdict

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.plan import Plan
from quantizer.contract.rules import TOTAL, TOTAL_RESIDENT
from quantizer.model.targets import GROUPS, ROUTED, targets
from quantizer.report import gib, table


def plan_summary(cfg: ModelConfig, plan: Plan) -> str:
    """K per group, routed experts per layer, aliases, bpw, and expected bytes per class."""
    by_group: dict[str, Counter] = {g: Counter() for g in GROUPS}
    layers: dict[int, list[float | None]] = defaultdict(list)
    for t in targets(cfg):
        k = plan.k[t.key]
        by_group[t.group][_k(k)] += 1
        if t.group == ROUTED:
            layers[t.layer].append(k)
    rows = [[g, ", ".join(f"{k} x{n:,}" for k, n in sorted(c.items()))] for g, c in by_group.items() if c]
    sizes = plan.expected_bytes
    lines = [
        f"{plan.made_by}; achieved {plan.achieved_bpw:.4f} {plan.profile.bits_measure} "
        f"(target {plan.target_bpw:g}); loader profile {plan.profile.name}; plan hash {plan.content_hash()[:16]}",
        table(["group", "K (count)"], rows, right=set()),
    ]
    if plan.profile.per_expert_k:
        lines.append("routed experts by layer (mean K): " + "; ".join(
            f"L{layer} {sum(ks) / len(ks):.2f}" for layer, ks in sorted(layers.items()) if None not in ks))
    else:
        lines.append("routed experts by layer: " + "; ".join(_runs({L: ks[0] for L, ks in layers.items()})))
    if plan.aliases:
        per_layer = Counter(int(cold.split(".")[1]) for cold in plan.aliases)
        lines.append(f"aliased cold experts: {len(plan.aliases)} (" +
                     ", ".join(f"L{layer} x{n}" for layer, n in sorted(per_layer.items())) + ")")
    lines += [
        "",
        table(["class", "GiB"], [[c, gib(n)] for c, n in sizes.items() if c not in (TOTAL, TOTAL_RESIDENT)]
              + [["total", gib(sizes[TOTAL])], ["without Engram tables", gib(sizes[TOTAL_RESIDENT])]]),
    ]
    return "\n".join(lines)


def _k(k: float | None) -> str:
    return "native" if k is None else f"{k:g}"


def _runs(layers: dict[int, float | None]) -> list[str]:
    """`L0-14 K3; L15-24 K2.5; ...` from a layer -> K map."""
    out, start = [], None
    order = sorted(layers)
    for i, layer in enumerate(order):
        if start is None:
            start = layer
        last = i + 1 == len(order) or layers[order[i + 1]] != layers[layer]
        if last:
            span = f"L{start}" if start == layer else f"L{start}-{layer}"
            out.append(f"{span} K{_k(layers[layer])}")
            start = None
    return out
