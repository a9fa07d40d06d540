"""The `quantization_config` an engine reads from config.json, where it is not exllamav3's own record.

Such a profile carries a template in its JSON (configs/loaders/, docs/loader-profiles.md): string values
starting with `$` are filled from the pack: `$bits`, `$bpw`, `$codebook`, `$head_bits`, `$drafter_bits`,
`$default_routed_k` (the most common routed K, within the profile's config_bits_range: what the engine
parses as `bits`), `$uniform_layer_bits` ({layer: K} of every layer whose routed experts all hold one K in
that range: vllm-exl3 sizes a uniform layer from `layer_bits`), `$source_block` (the source's FP8 block),
`$num_layers` (where the DSpark blocks start in vLLM's numbering) and `$source:KEY=DEFAULT` (the source's own
quantization_config KEY). The pack writer writes the filled template and verify refills it from what the
shards hold, both through `LoaderProfile.engine_quantization_config`.
"""

from __future__ import annotations

from collections import Counter

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.stored_linear import StoredLinear
from quantizer.exl3 import UNQUANTIZED
from quantizer.model.targets import DRAFT, HEAD_GROUP, ROUTED

EXLLAMAV3_FORM = "exllamav3"  # a profile whose engine reads exllamav3's own record (pack/exl3_config.py)


def template_values(qcfg: dict, source_config: dict, cfg: ModelConfig, linears: list[StoredLinear],
                    bits_range: tuple[int, int]) -> dict:
    """What a template's placeholders stand for, from exllamav3's record `qcfg`, the K the stored linears hold
    and the source."""
    by_group: dict[str, list[float]] = {HEAD_GROUP: [], DRAFT: []}
    routed: list[tuple[int, float]] = []
    for s in linears:
        if s.K is not None and s.K != UNQUANTIZED:
            by_group.setdefault(s.target.group, []).append(s.K)
            if s.target.group == ROUTED:
                routed.append((s.target.layer, s.K))
    lo, hi = bits_range
    common = Counter(k for _, k in routed).most_common(1)
    by_layer: dict[int, set[float]] = {}
    for layer, k in routed:
        by_layer.setdefault(layer, set()).add(k)
    head, drafter = by_group[HEAD_GROUP], by_group[DRAFT]
    return {
        "bits": qcfg["bits"], "bpw": round(qcfg["bpw"], 2), "codebook": qcfg["codebook"],
        "head_bits": _number(head[0]) if head else None,
        "drafter_bits": _number(Counter(drafter).most_common(1)[0][0]) if drafter else None,
        "default_routed_k": min(hi, max(lo, int(common[0][0]))) if common else lo,
        "uniform_layer_bits": {str(layer): int(next(iter(ks))) for layer, ks in sorted(by_layer.items())
                               if len(ks) == 1 and lo <= next(iter(ks)) <= hi},
        "source_block": [int(cfg.fp8_block[0]), int(cfg.fp8_block[1])], "num_layers": cfg.num_layers,
        "source": dict(source_config.get("quantization_config") or {}),
    }


def fill_template(template, values: dict):
    """The template with every `$placeholder` string replaced by its value (recursively)."""
    if isinstance(template, dict):
        return {k: fill_template(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [fill_template(v, values) for v in template]
    if not (isinstance(template, str) and template.startswith("$")):
        return template
    name = template[1:]
    if name.startswith("source:"):
        key, _, default = name[len("source:"):].partition("=")
        return values["source"].get(key, default)
    if name not in values:
        raise ValueError(f"loader template placeholder {template} is not one of {sorted(values)}")
    return values[name]


def _number(k: float) -> int | float:
    return int(k) if float(k).is_integer() else float(k)
