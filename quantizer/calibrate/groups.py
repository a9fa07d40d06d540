"""Which EXL3 targets share an input Hessian, and which forward report fills each one.

A Hessian group is one input space seen by one or more linears. Per trunk layer:
- `attn.input`: the attention input (attn_norm output), read by wq_a, wkv and the compressors'
  wkv / wgate (the attention's and, in V4, the indexer's);
- `attn.q_latent`: the q latent, read by wq_b and the indexer's wq_b;
- `attn.indexer.wk` (V4.1): the compressed latent the indexer's keys are projected from;
- `attn.wo_a.slice.<g>`: group g of the grouped wo_a input (exllamav3 stores wo_a as o_groups row
  slices, each reading only its own group, so each gets its own H; the wo_a target's H is their mean);
- `attn.wo_b`, `engram.wkv`, `ffn.shared_experts.w2`: each its own;
- `ffn.input`: the MoE input, read by the router, the shared expert's w1/w3 and every routed expert's
  w1/w3 (filled from the router's report, which always sees every token);
- `ffn.experts.<e>.w2`: each routed expert's down projection, from its routed tokens weighted by the
  squared routing weight, blended with an all-token prior (collect.py);
- `ffn.experts.<e>.input` (only with CalibrationSettings.expert_inputs): expert e's own H for its gate
  and up projections, from its routed tokens weighted by the routing weight, with the all-token
  `ffn.input` as its prior (made after the layer's rows from the kept MoE inputs and routing: collect.py).
The head has one group (`head`, the final hidden). Drafter (mtp) targets have none: the drafter is
not run by calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantizer.caches import process_cache
from quantizer.checkpoint.config import ModelConfig
from quantizer.model.targets import (
    ATTN,
    COMPRESSOR_PROJECTIONS,
    DRAFT,
    HEAD_GROUP,
    INDEX,
    ROUTED,
    SHARED,
    Target,
    target_map,
    targets,
)

SLICE = ".slice."  # stored-key infix of a wo_a row slice (quantizer/quantize/linears.py)
HEAD_KEY = "head"


@dataclass(frozen=True)
class HGroup:
    key: str  # "layers.3.attn.input", "layers.3.attn.wo_a.slice.1", "layers.3.ffn.experts.5.w2", "head"
    size: int  # input features
    layer: int | None  # None for the head
    reporter: str  # native weight name whose reported input fills it
    slice: int | None = None  # wo_a: the group index within the reported [.., groups, in/group] input
    expert: int | None = None  # routed w2 or expert input: the expert
    expert_input: bool = False  # the expert's own gate/up input (`ffn.experts.<e>.input`), not its w2

    @property
    def routed(self) -> bool:
        return self.expert is not None


def expert_input_key(layer: int, expert: int) -> str:
    return f"layers.{layer}.ffn.experts.{expert}.input"


def group_key(t: Target) -> str | None:
    """The group of a target (a wo_a target maps to its slice groups: see `wo_a_slices`); None for the drafter."""
    if t.group == DRAFT:
        return None
    base = f"layers.{t.layer}"
    if t.group in (ROUTED, SHARED) and t.proj in ("w1", "w3"):
        return f"{base}.ffn.input"
    if t.group in (ATTN, INDEX) and t.proj in ("wq_a", "wkv") + COMPRESSOR_PROJECTIONS:
        return f"{base}.attn.input"
    if t.proj == "wq_b" and t.group in (ATTN, INDEX):
        return f"{base}.attn.q_latent"
    if t.group == HEAD_GROUP:
        return HEAD_KEY
    return t.key  # wo_a (pooled over its slices), wo_b, indexer wk, w2s, engram wkv


def stored_group(key: str, t: Target, expert_inputs: bool = False) -> str | None:
    """The Hessian group a stored linear `key` of target `t` is encoded with: its target's group, except
    that each wo_a slice has its own and, with `expert_inputs`, a routed expert's gate/up projections
    their expert's own input group; None for the drafter (not calibrated)."""
    if expert_inputs and t.group == ROUTED and t.proj in ("w1", "w3"):
        return expert_input_key(t.layer, t.expert)
    group = group_key(t)
    return key if group is not None and SLICE in key else group


def wo_a_slices(cfg: ModelConfig, key: str) -> list[str]:
    return [f"{key}{SLICE}{g}" for g in range(cfg.o_groups)]


def _is_wo_a(t: Target) -> bool:
    return t.group == ATTN and t.proj == "wo_a"


_REPORTERS = {  # shared groups: the linear (or router) whose reported input fills them
    "ffn.input": "ffn.gate.weight",
    "attn.input": "attn.wq_a.weight",
    "attn.q_latent": "attn.wq_b.weight",
}


def layer_groups(cfg: ModelConfig, layer: int, expert_inputs: bool = False) -> tuple[HGroup, ...]:
    """The Hessian groups of trunk layer `layer`, in native target order; with `expert_inputs`, each
    routed expert's own input group too (after its w2's)."""
    return _model_groups(cfg, expert_inputs)[layer]


@process_cache(maxsize=4)
def _model_groups(cfg: ModelConfig, expert_inputs: bool) -> tuple[tuple[HGroup, ...], ...]:
    per_layer: list[dict[str, HGroup]] = [{} for _ in range(cfg.num_layers)]
    for t in targets(cfg):
        key = group_key(t)
        if key is None or t.group == HEAD_GROUP:
            continue
        groups = per_layer[t.layer]
        if _is_wo_a(t):
            for g, slice_key in enumerate(wo_a_slices(cfg, t.key)):
                groups[slice_key] = HGroup(slice_key, t.in_features, t.layer, f"{t.key}.weight", slice=g)
            continue
        if key in groups:
            continue
        local = key.split(".", 2)[2]
        reporter = f"layers.{t.layer}.{_REPORTERS[local]}" if local in _REPORTERS else f"{t.key}.weight"
        expert = t.expert if t.group == ROUTED and t.proj == "w2" else None
        groups[key] = HGroup(key, t.in_features, t.layer, reporter, expert=expert)
        if expert is not None and expert_inputs:
            own = expert_input_key(t.layer, expert)
            groups[own] = HGroup(own, cfg.hidden_size, t.layer, f"layers.{t.layer}.{_REPORTERS['ffn.input']}",
                                 expert=expert, expert_input=True)  # the router's input, kept per chunk
    return tuple(tuple(groups.values()) for groups in per_layer)


def head_group(cfg: ModelConfig) -> HGroup | None:
    head = target_map(cfg).get(HEAD_KEY)
    return None if head is None else HGroup(HEAD_KEY, head.in_features, None, "head.weight")
