"""Sensitivity: what each budgeted tensor's K costs in output error, for the allocator.

    cost_t(K) = importance_t x proxy_t(3) x (proxy_t(K) / proxy_t(3)) ^ EXPONENT

proxy_t(K) is the relative output error of tensor t at rate K (exllamav3's proxy_err,
tr(E H E^T) / tr(W H W^T)): measured values where the caller has them (e.g. from encoding each
tensor at each candidate K), otherwise the rate-distortion model: exllamav3's measured Gaussian
distortion per K (docs/exl3-format.md, distortion; K 7 interpolated) times the tensor's ldlq_factor
(how much LDLQ on its Hessian beats plain rounding). For a tensor measured at only some rates, the
other rates follow the model's shape through the measured points (the field's K4/K3 ratio is
~0.25 per bit, docs/field-evidence.md, so one measurement plus the model's slope suffices).

importance_t is the relative error energy that a unit relative error of t causes in the residual
streams (the hc streams a site writes into), so that tensors of every layer compare on one scale:

    importance_t = gain_site x part_t x factor_t

- gain_site: the layer's measured site gain (LayerStats.attn_gain / ffn_gain: the write energy of
  the site into the streams over the streams' energy, quantizer/calibrate/collect.py), so a
  relative error e in the site output y is a relative error ~ e x gain in the streams. On the
  bundled small model these gains fall with depth ~8x faster than the KL each site causes when
  perturbed; a gain measured as KL per unit relative error would serve better and drops in here
  unchanged (the formula only needs gains on one scale across layers).
- part_t: the share of the site output's energy that t's unit writes. Attention: 1 (every
  attention linear feeds the one output, y = wo_b(...)); the indexer query steers that same
  attention. MoE site: y = shared(x) + sum_e w_e expert_e(x); expert e writes
  r_e = out_energy(its w2) x routed tokens / calibration tokens (its w2 energy is already the
  routing-weighted mean per routed token), the shared expert s = out_energy(its w2); part =
  r_e / (s + sum r) or s / (s + sum r) (cross terms between experts neglected).
- factor_t: how a relative error of t's own output reaches the site output. 1 for w2, w3 (up:
  h = silu(g) * u, so a relative error of u is the same relative error of h, then linear through
  w2), wo_a, wo_b, wkv (the value path is linear) and the query/index projections (through norms
  and softmax, which neither amplify nor cancel it on average: first order, conservative).
  gate (w1) through SiLU: an error dg changes h by u * silu'(g) * dg; for g ~ N(0, s^2) with
  s^2 = out_energy(w1) / intermediate and errors spread evenly over channels the relative error
  of h is factor(s) = s^2 E[silu'(g)^2] / E[silu(g)^2] times that of g (Gauss-Hermite
  quadrature; 1.00 for small s, ~1.07 at s = 1, ~1.04 for large s), derived, not fitted.
- Engram's wkv writes straight into the streams before the attention site, with no mHC write
  coefficient and no measured gain: gain 1, part 1 (on the small model its KL per unit error was
  0.5-1.5x that, where the attention site's gain put it 4-10x too low).

EXPONENT bends the first-order model (importance x proxy, exact for small errors) around the
reference rate K 3: errors below it cost more than linearly, above it less. Its effect is to shrink
the spread of K that importance differences imply (the optimum has K_t = log4(importance_t) /
EXPONENT + const), which pays because importance estimates are noisy and errors of many tensors
add up in the same streams. Measured on the bundled small model by noise injection (each tensor
perturbed to its proxy at its K, KL against the native model on held-out rows): exponent 1.5 gave
7-24% lower KL than 1.0 at 2.5/2.9/3.5 bpw, 0.75 was worse than 1.0, 2.0 about as good as 1.5.

Routed experts of one (layer, projection) then share one importance, the geometric mean of the
group's: their routing shares on the calibration rows do not predict which expert's error costs
more on other text. On the bundled model (8 experts, top-2; mixedk at exllamav3's 2.5/2.9/3.5
budgets, KL on held-out rows) importance ~ share^beta gave KL 0.260 at 2.5 with beta 1 (the stock
plan: 0.238), 0.236/0.127/0.074 with beta 0.5 and 0.229/0.122/0.069 with beta 0. Topics
route to experts, so a few dozen calibration documents sample shares far less precisely than their
token counts suggest. The shares still price cold-expert aliases (below), where they decide.

Cold-expert aliases cost importance(w2 of the cold expert) x the aliasing error calibration
measured (||E_cold(x) - E_warm(x)||^2 / ||E_cold(x)||^2 over the cold expert's tokens), bent the
same way around its w2's reference proxy: an aliasing error of ~1 is far above any rate's, so only
experts of almost no importance are aliased (the field's advice: docs/field-evidence.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from quantizer.caches import process_cache
from quantizer.calibrate.summary import (
    MEASURED_KL,
    REFERENCE_RATE,
    CalibrationSummary,
    LayerStats,
    TensorStats,
    kl_unit,
)
from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.exl3 import model_proxy, rate_grid
from quantizer.model.targets import ENGRAM, ROUTED, SHARED, targets

PROXY_FLOOR = 1e-12  # measured proxies are clamped here before taking logs
EXPONENT = 1.5  # see the module docstring
ENGRAM_GAIN = 1.0


@process_cache(maxsize=1)
def _hermite() -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Hermite nodes and weights (normalised) for E[f(g)], g ~ N(0, 1), made on first use: every
    command imports this module (the parser's arguments), and an import should compute nothing."""
    x, w = np.polynomial.hermite_e.hermegauss(48)
    return x, w / w.sum()


def silu_gate_factor(sigma: np.ndarray) -> np.ndarray:
    """s^2 E[silu'(g)^2] / E[silu(g)^2] for g ~ N(0, s^2): a unit relative error of the gate
    projection as a relative error of silu(gate) * up (see the module docstring)."""
    nodes, weights = _hermite()
    s = np.maximum(np.asarray(sigma, dtype=float), 1e-6)[:, None]
    g = s * nodes[None, :]
    sig = 1.0 / (1.0 + np.exp(-g))
    silu = g * sig
    dsilu = sig * (1.0 + g * (1.0 - sig))
    return (s[:, 0] ** 2) * (dsilu ** 2 @ weights) / np.maximum(silu ** 2 @ weights, 1e-30)


@dataclass(frozen=True)
class AliasOption:
    """A cold routed expert that could be served by a warm expert of its layer."""

    expert: str  # `layers.L.ffn.experts.E`
    warm: str  # `layers.L.ffn.experts.W`
    layer: int
    relative_share: float  # its routed selections / the layer's mean per expert
    cost: float  # importance of its output x relative output error when aliased


@dataclass(frozen=True)
class Sensitivity:
    """Cost of every budgeted target at every candidate rate, in one array."""

    keys: tuple[str, ...]  # budgeted targets, in layout order
    rates: tuple[float, ...]  # the K axis: every rate of the codebook's grid
    importance: np.ndarray  # [T] error energy per unit relative error
    proxy: np.ndarray  # [T, R] relative output error at each rate
    measured: int  # how many targets carry caller-measured proxies
    aliases: tuple[AliasOption, ...]  # alias candidates from calibration
    synthetic: bool  # the summary was made up (synthetic_summary), not measured
    gains: str  # the summary's site sensitivity: MEASURED_KL (importance on the KL scale) or STREAM_ENERGY

    @property
    def cost(self) -> np.ndarray:
        """[T, R] estimated output error of each target at each rate (module docstring)."""
        return bent_cost(self.importance[:, None], self.proxy[:, [self.rates.index(REFERENCE_RATE)]], self.proxy)


def bent_cost(importance, reference, proxy):
    """importance x reference x (proxy / reference) ^ EXPONENT (module docstring)."""
    return importance * reference * (proxy / reference) ** EXPONENT


def sensitivity(
    cfg: ModelConfig,
    summary: CalibrationSummary,
    codebook: str = "mul1",
    measured: Mapping[str, Mapping[float, float]] | None = None,
) -> Sensitivity:
    """Importance and proxy error of every budgeted target; `measured` maps key -> {K: proxy_err}."""
    budgeted = [t for t in targets(cfg) if t.budgeted]
    rates = rate_grid(codebook)
    layers = _layer_stats(cfg, summary)
    tokens = float(summary.rows * summary.cols)
    if tokens <= 0:
        raise UserError("calibration summary has rows x cols = 0 tokens; run `quantizer calibrate` again")
    stats = summary.tensors

    def energy(key: str) -> TensorStats:
        s = stats.get(key)
        if s is None:
            raise UserError(f"calibration summary has no statistics for {key}; it was made for another "
                            "model or an older calibrate run; run `quantizer calibrate` again")
        return s

    parts = _ffn_parts(cfg, layers, energy, tokens)
    part = np.ones(len(budgeted))
    gain = np.empty(len(budgeted))
    ldlq = np.empty(len(budgeted))
    gate_sigma = np.full(len(budgeted), np.nan)  # only for w1 of routed and shared experts
    for i, t in enumerate(budgeted):
        ldlq[i] = energy(t.key).ldlq_factor
        layer = layers[t.layer]
        if t.group in (ROUTED, SHARED):
            gain[i] = layer.ffn_gain
            part[i] = parts[t.layer][t.expert if t.group == ROUTED else SHARED]
            if t.proj == "w1":
                gate_sigma[i] = np.sqrt(max(energy(t.key).out_energy, 0.0) / t.out_features)
        else:  # attention and indexer query; Engram's wkv writes straight into the streams
            gain[i] = ENGRAM_GAIN if t.group == ENGRAM else layer.attn_gain
    factor = np.ones(len(budgeted))
    gates = ~np.isnan(gate_sigma)
    factor[gates] = silu_gate_factor(gate_sigma[gates])
    importance = gain * part * factor
    proxy = model_proxy(rates, codebook)[None, :] * np.clip(ldlq, 0.0, None)[:, None]
    keys = tuple(t.key for t in budgeted)
    n_measured = _apply_measured(proxy, keys, rates, codebook, measured or {})
    row = {k: i for i, k in enumerate(keys)}
    ref = rates.index(REFERENCE_RATE)
    pooled = _pool_routed(budgeted, importance)
    if summary.gains == MEASURED_KL:
        scale = _kl_scale(budgeted, layers, pooled, proxy[:, ref], summary.kl_relative_error * np.clip(ldlq, 0.0, None))
        pooled, importance = pooled * scale, importance * scale

    def alias_cost(w2: str, error: float) -> float:  # a cold expert's own routed share prices its alias
        return float(bent_cost(importance[row[w2]], proxy[row[w2], ref], error))

    return Sensitivity(keys, rates, pooled, proxy, n_measured, _alias_options(cfg, layers, alias_cost),
                       summary.synthetic, summary.gains)


def _pool_routed(budgeted, importance: np.ndarray) -> np.ndarray:
    """Importance with each routed expert's replaced by the geometric mean of its (layer, projection)
    group (module docstring: routing shares measured on calibration rows mislead K choices)."""
    pooled = importance.copy()
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, t in enumerate(budgeted):
        if t.group == ROUTED:
            groups[t.layer, t.proj].append(i)
    for index in groups.values():
        values = importance[index]
        positive = values[values > 0]
        pooled[index] = float(np.exp(np.log(positive).mean())) if positive.size else 0.0
    return pooled


def _kl_scale(budgeted, layers: dict[int, LayerStats], importance: np.ndarray, reference: np.ndarray,
              noise: np.ndarray) -> np.ndarray:
    """[T] factor per target that makes its unit's modelled cost at the calibration probe's noise
    equal the KL calibration measured (module docstring); a unit without a measurement takes the
    geometric mean of the measured units' factors."""
    unit = [(t.layer, kl_unit(t.group)) for t in budgeted]
    modelled: dict[tuple[int, str], float] = defaultdict(float)
    for u, cost in zip(unit, bent_cost(importance, reference, noise)):
        modelled[u] += float(cost)
    factor = {u: layers[u[0]].unit_kl[u[1]] / m for u, m in modelled.items()
              if u[1] in layers[u[0]].unit_kl and m > 0}
    positive = [f for f in factor.values() if f > 0]
    fallback = float(np.exp(np.mean(np.log(positive)))) if positive else 1.0
    return np.array([max(factor.get(u, fallback), 0.0) for u in unit])


def _ffn_parts(cfg: ModelConfig, layers: dict[int, LayerStats], energy, tokens: float) -> dict[int, dict]:
    """Per layer: expert index (and SHARED) -> its share of the MoE output energy."""
    parts = {}
    for layer, stats in layers.items():
        if layer >= cfg.num_layers:
            continue
        routed = {e: energy(f"layers.{layer}.ffn.experts.{e}.w2").out_energy * stats.expert_tokens[e] / tokens
                  for e in range(cfg.n_routed_experts)}
        shared = energy(f"layers.{layer}.ffn.shared_experts.w2").out_energy if cfg.n_shared_experts else 0.0
        total = shared + sum(routed.values())
        parts[layer] = {e: r / total if total > 0 else 0.0 for e, r in routed.items()}
        parts[layer][SHARED] = shared / total if total > 0 else 0.0
    return parts


def _layer_stats(cfg: ModelConfig, summary: CalibrationSummary) -> dict[int, LayerStats]:
    layers = {s.layer: s for s in summary.layers}
    for layer in range(cfg.num_layers):
        s = layers.get(layer)
        if s is None:
            raise UserError(f"calibration summary has no routing statistics for layer {layer}; "
                            "run `quantizer calibrate` again on this model")
        if len(s.expert_weight) != cfg.n_routed_experts or len(s.expert_tokens) != cfg.n_routed_experts:
            raise UserError(f"calibration summary layer {layer} has {len(s.expert_weight)} experts, the model "
                            f"{cfg.n_routed_experts}; it was made for another model")
    return layers


def _apply_measured(proxy: np.ndarray, keys: tuple[str, ...], rates: tuple[float, ...], codebook: str,
                    measured: Mapping[str, Mapping[float, float]]) -> int:
    """Overwrite model rows with measurements; between and beyond measured rates keep the model's
    shape (log-ratio to the model interpolated in K, held constant past the ends)."""
    index = {k: i for i, k in enumerate(keys)}
    unknown = [k for k in measured if k not in index]
    if unknown:
        raise UserError(f"measured proxy errors name {unknown[0]}, which is not a budgeted target of this model")
    curve = np.log(model_proxy(rates, codebook))
    by_rates: dict[tuple[float, ...], list[tuple[int, dict[float, float]]]] = {}
    for key, table in measured.items():
        values = {float(k): float(v) for k, v in table.items()}
        if values:
            by_rates.setdefault(tuple(sorted(values)), []).append((index[key], values))
    grid = np.asarray(rates)
    for ks, rows in by_rates.items():
        # np.interp is linear in the values: one [len(ks), R] matrix interpolates every row at once
        basis = np.stack([np.interp(grid, ks, np.eye(len(ks))[i]) for i in range(len(ks))])
        values = np.array([[v[k] for k in ks] for _, v in rows])
        log_ratio = np.log(np.maximum(values, PROXY_FLOOR)) - np.log(model_proxy(ks, codebook))[None, :]
        proxy[[i for i, _ in rows]] = np.exp(curve[None, :] + log_ratio @ basis)
    return sum(len(g) for g in by_rates.values())


def _alias_options(cfg: ModelConfig, layers: dict[int, LayerStats], alias_cost) -> tuple[AliasOption, ...]:
    options = []
    for layer in range(cfg.num_layers):
        s = layers[layer]
        mean = sum(s.expert_tokens) / len(s.expert_tokens) if s.expert_tokens else 0.0
        for cold, (warm, rel_err) in sorted(s.alias_candidates.items()):
            if not (0 <= cold < cfg.n_routed_experts and 0 <= warm < cfg.n_routed_experts) or cold == warm:
                raise UserError(f"calibration summary layer {layer}: alias candidate {cold} -> {warm} is not a "
                                f"pair of distinct experts of this model")
            expert = f"layers.{layer}.ffn.experts.{cold}"
            rel = s.expert_tokens[cold] / mean if mean > 0 else 0.0
            options.append(AliasOption(expert, f"layers.{layer}.ffn.experts.{warm}", layer, rel,
                                       alias_cost(expert + ".w2", float(rel_err))))
    return tuple(options)


# ---- a synthetic summary for planning without a calibration run --------------------------------

SYNTHETIC_ROWS, SYNTHETIC_COLS = 384, 2048  # the size of the field's V4.1 routing study (786,432 tokens)


def synthetic_summary(cfg: ModelConfig, seed: int = 0) -> CalibrationSummary:
    """A plausible summary for any shape, from what the field measured on V4.1-Flash
    (docs/field-evidence.md, routing): Zipf-like routing (n_eff from about half the experts early to
    a sixth late), dead experts (< 64 of 786k tokens) rare early and up to 26 of 384 in the last
    layers, site gains taken from the ledger's write gains: ~6 in the first third, ~1 in the
    middle, 0.05-0.2 in the last layers. Energies and LDLQ factors are jittered around plain
    values (out_features per token; 0.6). Marked synthetic=True so a plan made from it says so."""
    rng = np.random.default_rng(seed)
    tokens = SYNTHETIC_ROWS * SYNTHETIC_COLS
    n, experts, k = cfg.num_layers, cfg.n_routed_experts, cfg.experts_per_token
    layers, tensors, mean_w2 = [], {}, []
    for layer in range(n):
        depth = layer / max(n - 1, 1)
        zipf = 0.5 + 0.3 * depth
        p = (np.arange(experts) + 1.0) ** -zipf * rng.lognormal(0.0, 0.3, experts)
        dead = int(round(np.interp(depth, [0.0, 0.5, 0.675, 1.0], [0.0, 2.0, 4.0, 26.0]) * experts / 384
                         * rng.uniform(0.5, 1.0)))
        order = rng.permutation(experts)
        p = p / p.sum()
        counts = p * tokens * k
        if dead:
            counts[-dead:] = rng.uniform(0, 64 * tokens / 786_432, dead)
        expert_tokens = np.zeros(experts)
        expert_tokens[order] = counts
        w2_mean = rng.lognormal(np.log(1.3 * (cfg.routed_scaling_factor / k) ** 2), 0.1, experts)
        expert_weight = expert_tokens * w2_mean
        gain = float(np.exp(np.interp(depth, [0.0, 0.33, 0.48, 0.75, 0.9, 1.0],
                                      np.log([6.0, 4.4, 1.0, 1.0, 0.2, 0.05]))) * rng.lognormal(0.0, 0.1))
        warm = np.argsort(-expert_tokens)[: max(1, experts // 2)]
        cold = [int(e) for e in np.flatnonzero(expert_tokens < 0.1 * expert_tokens.mean())]
        aliases = {e: (int(rng.choice(warm)), float(rng.uniform(0.5, 1.5))) for e in cold}
        layers.append(LayerStats(layer, [float(x) for x in expert_tokens], [float(x) for x in expert_weight],
                                 attn_gain=0.8 * gain, ffn_gain=gain, alias_candidates=aliases))
        mean_w2.append(w2_mean)
    for t in targets(cfg):
        if not t.budgeted:
            continue
        routed = t.group == ROUTED
        energy = t.out_features * rng.lognormal(0.0, 0.3)
        if routed and t.proj == "w2":  # routing-weighted per routed token, as calibrate measures it
            energy *= mean_w2[t.layer][t.expert]
        tensors[t.key] = TensorStats(tokens=layers[t.layer].expert_tokens[t.expert] if routed else float(tokens),
                                     out_energy=float(energy),
                                     ldlq_factor=float(min(1.0, 0.6 * rng.lognormal(0.0, 0.15))))
    return CalibrationSummary(f"synthetic:{cfg.arch}:seed{seed}", SYNTHETIC_ROWS, SYNTHETIC_COLS, tensors, layers,
                              synthetic=True)
