"""Mixture of experts: sqrt-softplus router with a selection bias, SwiGLU experts, one shared expert.

Router (in float32): s = sqrt(softplus(x·Wg^T)); experts = top-k of s + gate.bias (the bias only
selects); V4 hash layers (layer < num_hash_layers) take the experts from `tid2eid[token]` instead.
Weights = s[selected] / sum(s[selected]) (norm_topk_prob) * routed_scaling_factor.
Expert: w2(silu(min(w1·x, limit)) * clamp(w3·x, -limit, limit)). Output = sum of weighted routed
experts + the shared expert. V4.1's `gate.bias_vl` selects for image rows; this text-only forward
holds it but never uses it.

Tokens are grouped by expert with one sort; each expert runs once on its contiguous slice (a loop
over experts, never over tokens) and one index_copy puts the outputs back. With `ForwardHooks.all_experts`,
every expert also sees every token so that its
linears' inputs are observed for all of them; outputs still come from the routed rows only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from quantizer.checkpoint.config import V41, ModelConfig
from quantizer.model.hooks import ForwardHooks, RoutingEvent
from quantizer.model.linear import NativeLinear


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        D = cfg.hidden_size
        self.limit = cfg.swiglu_limit
        self.w1 = NativeLinear(D, intermediate, f"{prefix}.w1.weight", dtype)
        self.w2 = NativeLinear(intermediate, D, f"{prefix}.w2.weight", dtype)
        self.w3 = NativeLinear(D, intermediate, f"{prefix}.w3.weight", dtype)

    def hidden(self, x: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """silu(min(w1·x, limit)) * clamp(w3·x, ±limit), in the weights' dtype."""
        gate = self.w1(x, hooks).clamp(max=self.limit)
        up = self.w3(x, hooks).clamp(-self.limit, self.limit)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, hooks: ForwardHooks | None = None) -> torch.Tensor:
        return self.w2(self.hidden(x, hooks), hooks)


class Router(NativeLinear):
    """`ffn.gate`: the scoring weight plus the selection bias, or the hash table on V4 hash layers."""

    def __init__(self, cfg: ModelConfig, experts: int, hashed: bool, prefix: str, dtype: torch.dtype):
        super().__init__(cfg.hidden_size, experts, f"{prefix}.weight", dtype)
        self.k = cfg.experts_per_token
        self.scaling = cfg.routed_scaling_factor
        self.normalize = cfg.norm_topk_prob
        self.hashed = hashed
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(experts, dtype=torch.float32))
            if cfg.arch == V41:
                self.register_buffer("bias_vl", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, hooks: ForwardHooks | None = None):
        """x [N, D], tokens [N] -> (scores [N, E], expert ids [N, k], weights [N, k]), fp32."""
        weight = self.resolved_weight(x, hooks)
        with torch.autocast(x.device.type, enabled=False):  # float32 even inside bf16 autocast (training)
            scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
        if self.hashed:
            ids = self.tid2eid[tokens]
        else:
            ids = torch.topk(scores.detach() + self.bias, self.k, dim=-1).indices
        return scores, ids, self.weigh(scores, ids)

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights: their scores, normalised over the choice, times the scaling factor."""
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.name = prefix.rsplit(".", 1)[0]
        experts = cfg.experts_in("layers")
        self.gate = Router(cfg, experts, cfg.is_hash_layer(layer), f"{prefix}.gate", dtype)
        I = cfg.moe_intermediate_size
        self.experts = nn.ModuleList(Expert(cfg, I, f"{prefix}.experts.{e}", dtype) for e in range(experts))
        self.shared_experts = Expert(cfg, I * cfg.n_shared_experts, f"{prefix}.shared_experts", dtype)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D] float32."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, ids, weights = self.gate(flat, tokens.reshape(-1), hooks)
        forced = None if hooks is None or hooks.expert_override is None else hooks.expert_override(self.name, ids)
        if forced is not None:
            ids, weights = forced, self.gate.weigh(scores, forced)
        if hooks is not None and hooks.routing is not None:
            hooks.routing(RoutingEvent(self.name, scores.detach(), ids, weights.detach()))
        out = self._routed(flat, ids, weights, hooks) + self.shared_experts(flat, hooks).float()
        return out.view(shape)

    def _routed(self, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                hooks: ForwardHooks | None) -> torch.Tensor:
        """Sort the (token, slot) pairs by expert, run each expert on its contiguous slice, put the
        outputs back in pair order and sum each token's k weighted outputs."""
        N, k = ids.shape
        order = ids.reshape(-1).argsort(stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=len(self.experts)).tolist()
        inputs = flat[order // k]
        all_experts = hooks is not None and hooks.all_experts
        quiet = dataclasses.replace(hooks, linear_input=None) if all_experts else None
        outputs = []
        start = 0
        for e, count in enumerate(counts):
            expert = self.experts[e]
            if all_experts:
                hidden = expert.hidden(flat, hooks)
                if hooks.linear_input is not None:
                    hooks.linear_input(expert.w2.native_name, hidden.detach())
                outputs.append(expert.w2(hidden[order[start:start + count] // k], quiet))
            elif count:
                outputs.append(expert(inputs[start:start + count], hooks))
            start += count
        ordered = torch.cat(outputs)
        per_pair = torch.empty_like(ordered).index_copy(0, order, ordered).view(N, k, -1)
        return torch.bmm(weights.unsqueeze(1).to(per_pair.dtype), per_pair).squeeze(1).float()
