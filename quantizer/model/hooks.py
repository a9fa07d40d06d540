"""Observation and override points of the reference forward, for calibration and quality checks.

Hooks never change outputs (an override changes the weight used, by the caller's choice). Every
linear reports its input under its native weight name (`layers.3.attn.wq_a.weight`), the last
dimension of the reported tensor being the weight's input features: grouped `wo_a` reports
[tokens, groups, in/group], since all groups share its input space. Routers report their choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingEvent:
    layer: str  # "layers.3"
    scores: torch.Tensor  # [tokens, experts] sqrt(softplus(logits)), fp32, before the selection bias
    expert_ids: torch.Tensor  # [tokens, k]
    weights: torch.Tensor  # [tokens, k] as applied (normalised, times routed_scaling_factor)


@dataclass(frozen=True)
class ScaledCodes:
    """A weight given as `svh[:, None] * codes * suh[None, :]` (an EXL3 linear with its fixed codes and free
    scales, docs/tuning.md). The linear applies it to activations, `svh * linear(x * suh, codes)`, and
    never builds the weight, so a differentiable use holds the codes once and no weight-sized gradient.
    A grouped weight (wo_a) may give one suh per row block: suh [groups, in]."""

    codes: torch.Tensor  # [out, in]
    suh: torch.Tensor  # [in] or [groups, in]
    svh: torch.Tensor  # [out]

    def weight(self) -> torch.Tensor:
        """The weight itself, [out, in] (for a caller that needs it whole)."""
        if self.suh.dim() == 1:
            return self.svh.unsqueeze(1) * self.codes * self.suh.unsqueeze(0)
        groups, cols = self.suh.shape
        blocks = self.codes.view(groups, -1, cols) * self.suh.unsqueeze(1)
        return self.svh.unsqueeze(1) * blocks.reshape(self.codes.shape)


@dataclass
class ForwardHooks:
    """linear_input(name, x): called with each linear's (detached) input before it is applied.
    routing(event): called once per MoE layer and forward chunk.
    weight_override(name, weight) -> tensor or None: a replacement weight for this call, e.g. a
    decoded EXL3 weight; None keeps the model's own.
    scaled_codes(name) -> ScaledCodes or None: the weight as fixed codes and scales, applied to activations
    (differentiable in the scales, for tuning); takes precedence over weight_override.
    expert_override(layer, expert_ids) -> ids or None: other experts for this chunk's tokens ([tokens, k]),
    weighted by the router's own scores as its choice would be (e.g. the native model's choices on a
    quantized model, bench/routing_bound.py); None keeps the router's choice.
    all_experts: every token also goes through every routed expert so that linear_input sees
    each expert's input for all tokens (Hessians); the MoE output still uses the top-k only."""

    linear_input: Callable[[str, torch.Tensor], None] | None = None
    routing: Callable[[RoutingEvent], None] | None = None
    weight_override: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None
    scaled_codes: Callable[[str], ScaledCodes | None] | None = None
    expert_override: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None
    all_experts: bool = False
