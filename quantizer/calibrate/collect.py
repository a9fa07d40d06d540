"""One block's calibration statistics over every row chunk: the forward hooks and what they fill.

Per Hessian group (groups.py) a sum of x x^T and a row count, on the compute device: each report's
product in float32, added to a float64 sum, so the sum is the exact sum of those float32 products
(short of a 2^-29 cancellation) whatever their order: the same when the row chunks are split over
ranks (quantizer/distributed.py) and the ranks' partial sums reduced. That costs twice the float32
bytes of the layer's Hessians in device memory. The
forward reports each linear's input (ForwardHooks.linear_input); a group is filled from exactly one
report: the router's input for the shared MoE input, wq_a's for the attention input, wq_b's for the
q latent, wo_a's group g for its slice g, the linear's own for the rest.

A routed expert's down projection sees h = its hidden activation; its output is scaled by the routing
weight w, so its error is weighted by w^2: S_e = sum_routed w^2 h h^T, plus an all-token prior (see
CalibrationSettings.prior_tokens) so that an expert calibration barely reaches still gets a full-rank,
usable H. With all_experts the forward runs every token through every expert and reports h for all
of them, so one product per chunk adds both parts: S_e += h^T diag(beta + w_e^2) h, with
beta = prior_tokens * w2 / tokens (w2: the layer's mean squared routing weight, from its first chunk).
Without it, the routed part comes from the routed rows and the prior, after the layer ran, from
`sample_tokens` evenly spaced MoE inputs pushed through each expert.

CalibrationSettings.expert_hessians sets the power p of w in those weights (2 by default: w^2, beta and
w2 then use w^p and its layer mean) and, when not `shared`, gives each expert's gate/up projections a
group of their own: S_e = sum_routed w^p x x^T over the MoE inputs x routed to e, plus prior_tokens *
mean(w^p) times the layer's all-token MoE-input mean (`ffn.input`): the same blend as the down
projection's, with the prior computed exactly instead of pushed through the expert. These groups are
not summed while the rows run: each chunk's MoE input and routing are kept (hidden_size values per
token), and after the layer's last chunk the experts' sums are made one at a time, each reduced to rank
0, finished and packed there before the next. So the device holds one expert's square instead of all
of them (on DeepSeek-V4.1-Flash at 250 x 2048 rows: 4.9 GiB of kept bf16 inputs instead of 75 GiB of
float64 sums), and the products are the same per chunk as if summed on the way. The allocator's
statistics keep reading the shared `ffn.input` for gate/up.

Routing: per expert the top-k selections and the sum of squared routing weights. Site gains: the
write energy of each mHC site into the residual streams relative to the streams it writes into,
gain = sum_t ||post_t (x) y_t||^2 / sum_t ||streams_t||^2 = sum_t ||post_t||^2 ||y_t||^2 / sum_t ||streams_t||^2
(post: the site's write coefficients over the hc streams; y: the attention or MoE output), so a
relative error e in y becomes a relative error ~ e * gain in the streams (squared norms). The
site's streams and mixes are recomputed from the block's input and its sublayer outputs, which
forward hooks on the block's engram/attn/ffn modules capture.

Several ranks: each runs a contiguous share of the row chunks (chunk 0 on rank 0, whose first
routing sets the layer's w2 for all), keeps its samples by the chunks' global indices, and `reduce`
brings sums, counts and samples to rank 0, which finishes the layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from quantizer.calibrate.analysis import alias_errors, ldlq_factor, out_energy
from quantizer.calibrate.groups import HGroup, group_key, layer_groups, wo_a_slices
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.storage import STORAGE_DTYPES, pack_hessian
from quantizer.calibrate.summary import LayerStats, TensorStats
from quantizer.checkpoint.config import ModelConfig
from quantizer.distributed import Ranks
from quantizer.model.block import Block
from quantizer.model.hooks import ForwardHooks, RoutingEvent
from quantizer.model.mhc import hc_expand, hc_mix
from quantizer.model.targets import ROUTED, targets


def accumulate(total: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None = None) -> None:
    """total (float64) += rows^T diag(weights) rows, the product computed in float32."""
    x = rows.float()
    total.add_(torch.mm((x if weights is None else x * weights.unsqueeze(1)).T, x))


def quota(total: int, chunks: int, chunk: int) -> int:
    """Chunk `chunk`'s share of `total` samples: ceil(total / chunks) each until the total is reached."""
    each = math.ceil(total / chunks)
    return max(0, min(each, total - chunk * each))


@dataclass
class LayerResult:
    hessians: dict[str, torch.Tensor]  # group -> packed parts, on the CPU (storage.pack_hessian)
    counts: dict[str, float]  # group -> tokens its mean stands for (routed down: routed + prior tokens)
    layer: LayerStats
    tensors: dict[str, TensorStats]

    def meta(self) -> dict:
        return {"counts": self.counts, "layer": self.layer.to_dict(),
                "tensors": {k: asdict(v) for k, v in self.tensors.items()}}


class LayerCollector:
    def __init__(self, cfg: ModelConfig, layer: int, settings: CalibrationSettings, total_tokens: int,
                 chunks: int, device: torch.device, ranks: Ranks = Ranks(), first_chunk: int = 0):
        """chunks: all row chunks of the calibration; this rank runs those from first_chunk on."""
        self.cfg, self.layer, self.settings = cfg, layer, settings
        self.total_tokens, self.chunks, self.device = total_tokens, chunks, device
        self.ranks, self.chunk = ranks, first_chunk  # the global index of the chunk being run
        self.groups = layer_groups(cfg, layer, settings.expert_inputs)
        summed = [g for g in self.groups if not g.expert_input]  # the experts' own inputs come after the rows
        self.own_groups = [g for g in self.groups if g.expert_input]
        self.by_reporter: dict[str, list[HGroup]] = {}
        for g in summed:
            self.by_reporter.setdefault(g.reporter, []).append(g)
        self.router = f"layers.{layer}.ffn.gate.weight"
        self.sums = {g.key: torch.zeros(g.size, g.size, dtype=torch.float64, device=device) for g in summed}
        self.rows = {g.key: 0 for g in summed}
        self.kept_routing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per chunk (x, ids, w^p)
        self.own_packed: dict[str, dict[str, torch.Tensor]] = {}  # finished own-input groups, packed (rank 0)
        self.own_counts: dict[str, float] = {}
        self.experts = cfg.experts_in("layers")
        self.expert_tokens = torch.zeros(self.experts, dtype=torch.float64, device=device)
        self.expert_weight = torch.zeros(self.experts, dtype=torch.float64, device=device)  # sum of w^2
        self.hessian_weight = torch.zeros(self.experts, dtype=torch.float64, device=device)  # sum of w^p
        self.mean_w2: float | None = None  # the layer's mean squared routing weight (first chunk)
        self.mean_wp = 0.0  # and its mean w^p (the prior's weight per token), from the same chunk
        self.samples: list[list[torch.Tensor]] = [[] for _ in range(self.experts)]  # routed MoE inputs
        self.sample_all: list[torch.Tensor] = []  # evenly spaced MoE inputs of every chunk
        self.site_energy = {site: torch.zeros(2, dtype=torch.float64, device=device) for site in ("attn", "ffn")}
        self._moe_input: torch.Tensor | None = None
        self._routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [N, k], w^p [N, k]) of this chunk
        self.hooks = ForwardHooks(linear_input=self._linear_input, routing=self._routed,
                                  all_experts=settings.all_experts)

    # --- the forward -------------------------------------------------------------------------

    def run(self, block: Block, parts: list, hasher) -> None:
        """Every row chunk through the block, in place: parts[i] = (streams after the block, state)."""
        outputs: dict[str, torch.Tensor] = {}
        handles = [module.register_forward_hook(lambda _m, _a, out, site=site: outputs.__setitem__(site, out))
                   for site, module in (("engram", block.engram), ("attn", block.attn), ("ffn", block.ffn))
                   if module is not None]
        try:
            for i, (streams, state) in enumerate(parts):
                out = block(streams, state, hasher, self.hooks)
                rebuilt = self._site_gains(block, outputs.get("engram", streams), outputs["attn"], outputs["ffn"],
                                           rebuild=i == 0)
                if rebuilt is not None and not torch.allclose(rebuilt, out, rtol=1e-4, atol=1e-5):
                    raise RuntimeError(f"layers.{self.layer}: the site-gain recomputation no longer reproduces "
                                       "the block's output; update collect.py to the block's wiring")
                del rebuilt
                outputs.clear()
                parts[i] = (out, state)
                self._moe_input = self._routing = None
                self.chunk += 1
        finally:
            for handle in handles:
                handle.remove()
        if self.mean_w2 is None:  # a rank without chunks still takes part in sharing it
            self._share_means(None)

    def _share_means(self, w: torch.Tensor | None) -> None:
        """The layer's mean w^2 and w^p over chunk 0's routing weights w (on rank 0), on every rank."""
        means = [float(w.square().mean()), float(w.pow(self.settings.gate_power).mean())] if w is not None else [0, 0]
        value = torch.tensor(means, dtype=torch.float64, device=self.device)
        self.ranks.from_main(value)
        self.mean_w2, self.mean_wp = value.tolist()

    def reduce(self) -> None:
        """Sums, counts, energies and samples of every rank summed (or gathered in chunk order) on
        rank 0, then the experts' own input Hessians made from the kept routing; the other ranks keep
        partials and finish nothing."""
        if self.ranks.joined:
            self._reduce_sums()
        if self.own_groups:
            self._finish_expert_inputs()

    def _reduce_sums(self) -> None:
        rows = torch.tensor(list(self.rows.values()), dtype=torch.float64, device=self.device)
        for t in [*self.sums.values(), self.expert_tokens, self.expert_weight, self.hessian_weight,
                  *self.site_energy.values(), rows]:
            self.ranks.sum_to_main(t)
        self.rows = dict(zip(self.rows, map(int, rows.tolist())))
        width = self.cfg.hidden_size
        empty = torch.empty(0, width, dtype=self.settings.dtype, device=self.device)
        mine = [torch.cat(s) if s else empty for s in self.samples + [self.sample_all]]
        every = self.ranks.gather_parts(mine)
        self.samples = [[r[e] for r in every] for e in range(self.experts)]
        self.sample_all = [r[-1] for r in every]

    def _linear_input(self, name: str, x: torch.Tensor) -> None:
        groups = self.by_reporter.get(name)
        if name == self.router:
            self._moe_input = x
        for g in groups or ():
            if g.routed:
                self._routed_rows(g, x)
                continue
            rows = (x[..., g.slice, :] if g.slice is not None else x).reshape(-1, g.size)
            accumulate(self.sums[g.key], rows)
            self.rows[g.key] += rows.shape[0]

    def _routed(self, event: RoutingEvent) -> None:
        ids, w = event.expert_ids, event.weights.float()
        if self.mean_w2 is None:
            self._share_means(w)
        flat = ids.reshape(-1)
        wp = w.pow(self.settings.gate_power)
        self.expert_tokens += torch.bincount(flat, minlength=self.experts).double()
        self.expert_weight.index_add_(0, flat, w.square().reshape(-1).double())
        self.hessian_weight.index_add_(0, flat, wp.reshape(-1).double())
        self._routing = (ids, wp)
        if self.own_groups:
            self.kept_routing.append((self._moe_input, ids, wp))
        self._keep_samples(ids)

    def _routed_rows(self, g: HGroup, x: torch.Tensor) -> None:
        """A routed group's rows, each weighted by its token's w^p for the expert (plus, for a down
        projection in all-experts mode, the prior's beta on every token)."""
        ids, wp = self._routing
        if self.settings.all_experts:  # the report holds every token
            weights = (wp * (ids == g.expert)).sum(1) + self.settings.prior_tokens * self.mean_wp / self.total_tokens
        else:
            weights = wp.reshape(-1)[ids.reshape(-1) == g.expert]  # the MoE's (stable) expert-sorted order
            if weights.numel() != x.shape[0]:
                raise RuntimeError(f"{g.key}: {x.shape[0]} routed rows but {weights.numel()} selections")
        accumulate(self.sums[g.key], x, weights)

    def _keep_samples(self, ids: torch.Tensor) -> None:
        """Up to alias_tokens routed MoE inputs per expert and sample_tokens of all of them, spread
        evenly over each chunk's rows (each chunk's quota of each total, whatever the others kept)."""
        x, (N, k) = self._moe_input, ids.shape
        per_chunk = quota(self.settings.alias_tokens, self.chunks, self.chunk)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            take = min(per_chunk, count)
            if take > 0:
                picks = order[start + torch.arange(take, device=order.device) * count // take] // k
                self.samples[e].append(x[picks].clone())
            start += count
        take = min(quota(self.settings.sample_tokens, self.chunks, self.chunk), N)
        if take > 0:
            self.sample_all.append(x[torch.arange(take, device=x.device) * N // take].clone())

    def _site_gains(self, block: Block, streams: torch.Tensor, y_attn: torch.Tensor, y_ffn: torch.Tensor,
                    rebuild: bool) -> torch.Tensor | None:
        """Add both sites' energies; with `rebuild`, return the block output rebuilt from them (a
        wiring check, made on each layer's first chunk)."""
        cfg = self.cfg
        mix = hc_mix(streams, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, cfg)
        self._add_site("attn", streams, mix.post, y_attn)
        streams = hc_expand(streams, y_attn, mix)
        mix = hc_mix(streams, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, cfg)
        self._add_site("ffn", streams, mix.post, y_ffn)
        return hc_expand(streams, y_ffn, mix) if rebuild else None

    def _add_site(self, site: str, streams: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> None:
        write = (post.square().sum(-1) * y.float().square().sum(-1)).sum()
        self.site_energy[site] += torch.stack([write.double(), streams.square().sum().double()])

    # --- after the last chunk ------------------------------------------------------------------

    def finish(self, block: Block) -> LayerResult:
        """Mean Hessians (packed for storage), routing, per-tensor statistics and alias candidates."""
        if not self.settings.all_experts:
            self._sampled_prior(block)
        means, counts = self._means()
        factors = {key: ldlq_factor(h) if counts[key] > 0 else 1.0 for key, h in means.items()}
        tensors = self._tensor_stats(block, means, factors)
        expert_dtype = STORAGE_DTYPES[self.settings.expert_hessian_dtype]
        packed: dict[str, torch.Tensor] = {}
        for g in self.groups:
            packed.update(self.own_packed.pop(g.key) if g.expert_input else
                          pack_hessian(g.key, means.pop(g.key), expert_dtype if g.routed else torch.float32))
        counts.update(self.own_counts)
        counts = {g.key: counts[g.key] for g in self.groups}
        gains = {site: float(e[0] / e[1].clamp(min=1e-30)) for site, e in self.site_energy.items()}
        stats = LayerStats(self.layer, self.expert_tokens.tolist(), self.expert_weight.tolist(),
                           gains["attn"], gains["ffn"], self._alias_candidates(block))
        return LayerResult(packed, counts, stats, tensors)

    def _sampled_prior(self, block: Block) -> None:
        sample = torch.cat(self.sample_all)
        beta = self.settings.prior_tokens * self.mean_wp / len(sample)
        for g in self.groups:
            if g.routed and not g.expert_input:
                hidden = block.ffn.experts[g.expert].hidden(sample, None)
                accumulate(self.sums[g.key], hidden, torch.full((len(sample),), beta, device=sample.device))

    def _finish_expert_inputs(self) -> None:
        """Each routed expert's own gate/up Hessian, one expert at a time: its routed rows of every kept
        chunk weighted by w^p (the same float32 product per chunk as a running sum would add), summed
        over the ranks, plus prior_tokens * mean(w^p) x the layer's all-token MoE-input mean, divided by
        its weight and packed on rank 0. The kept inputs go when the last expert is done."""
        kept = []
        for x, ids, wp in self.kept_routing:  # each chunk's (token, slot) pairs grouped by expert, once
            flat = ids.reshape(-1)
            order = flat.argsort(stable=True)  # ascending tokens within an expert: a token picks it once
            ends = torch.bincount(flat, minlength=self.experts).cumsum(0).tolist()
            kept.append((x, order, [0, *ends], wp.reshape(-1), ids.shape[1]))
        shared = f"layers.{self.layer}.ffn.input"
        prior_weight = self.settings.prior_tokens * self.mean_wp
        prior = (self.sums[shared] * (prior_weight / max(self.rows[shared], 1)) if self.ranks.main else None)
        expert_dtype = STORAGE_DTYPES[self.settings.expert_hessian_dtype]
        for g in self.own_groups:
            total = torch.zeros(g.size, g.size, dtype=torch.float64, device=self.device)
            for x, order, starts, wp, k in kept:
                pairs = order[starts[g.expert]:starts[g.expert + 1]]
                if len(pairs):
                    accumulate(total, x[pairs // k], wp[pairs])
            self.ranks.sum_to_main(total)
            if self.ranks.main:
                weight = float(self.hessian_weight[g.expert]) + prior_weight
                mean = total.add_(prior).float()
                self.own_packed[g.key] = pack_hessian(g.key, mean.div_(weight) if weight > 0 else mean,
                                                         expert_dtype)
                self.own_counts[g.key] = float(self.expert_tokens[g.expert]) + self.settings.prior_tokens
            del total
        self.kept_routing.clear()

    def _means(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Each summed group's sum divided, in place, by its weight; counts in tokens."""
        means, counts = {}, {}
        prior_weight = self.settings.prior_tokens * self.mean_wp
        for g in self.groups:
            if g.expert_input:
                continue
            total = self.sums.pop(g.key)
            if g.routed:
                weight = float(self.hessian_weight[g.expert]) + prior_weight
                counts[g.key] = float(self.expert_tokens[g.expert]) + self.settings.prior_tokens
            else:
                weight = counts[g.key] = float(self.rows[g.key])
            total = total.float()
            means[g.key] = total.div_(weight) if weight > 0 else total
        return means, counts

    def _tensor_stats(self, block: Block, means: dict, factors: dict) -> dict[str, TensorStats]:
        prefix = f"layers.{self.layer}."
        tokens = float(self.total_tokens)
        out: dict[str, TensorStats] = {}
        for t in targets(self.cfg):
            if not t.key.startswith(prefix):
                continue
            weight = block.get_submodule(t.key[len(prefix):]).weight
            routed = t.group == ROUTED
            n_routed = float(self.expert_tokens[t.expert]) if routed else tokens
            if t.proj == "wo_a":
                keys = wo_a_slices(self.cfg, t.key)
                rows = weight.shape[0] // len(keys)
                energy = sum(out_energy(weight[i * rows:(i + 1) * rows], means[k]) for i, k in enumerate(keys))
                out[t.key] = TensorStats(tokens, energy, sum(factors[k] for k in keys) / len(keys))
                continue
            key = group_key(t)
            energy = out_energy(weight, means[key])
            if routed and t.proj == "w2":
                # the routing weight scales this projection's output: E[w^2 ||W h||^2] per routed token
                energy *= float(self.expert_weight[t.expert]) / n_routed if n_routed else self.mean_w2
            out[t.key] = TensorStats(n_routed, energy, factors[key])
        return out

    def _alias_candidates(self, block: Block) -> dict[int, tuple[int, float]]:
        counts = self.expert_tokens.tolist()
        threshold = self.settings.cold_share * sum(counts) / self.experts
        limit = int(self.settings.max_cold_fraction * self.experts)
        cold = sorted((e for e in range(self.experts) if counts[e] < threshold), key=lambda e: (counts[e], e))[:limit]
        chosen = set(cold)
        warm = [e for e in range(self.experts) if e not in chosen]
        everyone = torch.cat(self.sample_all)
        size = min(self.settings.alias_tokens, len(everyone))
        fallback = everyone[torch.arange(size, device=everyone.device) * len(everyone) // size]
        inputs = []
        for e in cold:
            kept = torch.cat(self.samples[e]) if self.samples[e] else fallback[:0]
            inputs.append(kept if len(kept) >= self.settings.alias_min_tokens else fallback)
        return alias_errors(block.ffn.experts, cold, warm, inputs)
