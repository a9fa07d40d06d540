"""plan/sensitivity.py: the rate-distortion model, measured proxies, the importance of each tensor
(site gain x share of the site's output x projection factor), alias costs and the synthetic summary."""

from __future__ import annotations

import numpy as np
import pytest

from quantizer.calibrate.summary import REFERENCE_RATE, CalibrationSummary, LayerStats, TensorStats
from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.exl3 import MUL1_MSE, model_proxy, rate_grid
from quantizer.model.targets import ROUTED, SHARED, targets
from quantizer.plan.sensitivity import ENGRAM_GAIN, EXPONENT, sensitivity, silu_gate_factor, synthetic_summary
from quantizer.shipped import model_config_path


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_file(model_config_path("tiny-v41.json"))


@pytest.fixture
def v41(real_v41):  # tests/conftest.py: shared by the session
    return real_v41


def hand_summary(cfg: ModelConfig) -> CalibrationSummary:
    """Every energy 2, LDLQ factor 0.5, gains attn 0.3 / ffn 0.7 except layer 1; expert e of each
    layer routed (e + 1) x 100 times out of 1000 tokens; layer 0 expert 1 may alias expert 0."""
    tensors = {t.key: TensorStats(100.0, 2.0, 0.5) for t in targets(cfg) if t.budgeted}
    layers = []
    for layer in range(cfg.num_layers):
        counts = [100.0 * (e + 1) for e in range(cfg.n_routed_experts)]
        gains = (0.3, 0.7) if layer != 1 else (2.0, 5.0)
        aliases = {1: (0, 0.8)} if layer == 0 else {}
        layers.append(LayerStats(layer, counts, [c / 4 for c in counts], *gains, alias_candidates=aliases))
    return CalibrationSummary("hand", 10, 100, tensors, layers)


def test_model_proxy_is_exllamav3s_table():
    rates = rate_grid("mul1")
    proxy = model_proxy(rates)
    for k, mse in MUL1_MSE.items():
        assert proxy[rates.index(k)] == pytest.approx(mse)
    assert proxy[rates.index(7.0)] == pytest.approx(np.sqrt(0.0004 * 0.0001))  # log-linear between 6 and 8
    assert np.all(np.diff(proxy) < 0)
    # docs/field-evidence.md: EXL3 K4/K3 proxy ratio ~0.25 (measured 0.252-0.269 on V4.1)
    assert 0.24 < proxy[rates.index(4.0)] / proxy[rates.index(3.0)] < 0.27
    assert model_proxy([2.0, 4.0], "mcg")[0] == pytest.approx(0.068 * np.sqrt(1.088 * 1.022))


def test_silu_gate_factor_matches_monte_carlo():
    rng = np.random.default_rng(0)
    for sigma in (0.2, 1.0, 3.0):
        g = rng.normal(0, sigma, 400_000)
        u = rng.normal(0, 1, g.size)
        dg = 1e-3 * sigma * rng.normal(0, 1, g.size)  # relative error 1e-3 of the gate output
        silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
        h, dh = silu(g) * u, (silu(g + dg) - silu(g)) * u
        measured = (dh ** 2).mean() / (h ** 2).mean() / 1e-6
        assert silu_gate_factor(np.array([sigma]))[0] == pytest.approx(measured, rel=0.03)
    assert silu_gate_factor(np.array([1e-3]))[0] == pytest.approx(1.0, abs=1e-3)


def test_importance_is_gain_times_share_of_site_output(tiny):
    sens = sensitivity(tiny, hand_summary(tiny))
    imp = dict(zip(sens.keys, sens.importance))
    experts = tiny.n_routed_experts
    tokens = 1000.0
    routed = [2.0 * 100 * (e + 1) / tokens for e in range(experts)]  # out_energy(w2) x routed tokens / tokens
    total = 2.0 + sum(routed)  # + shared expert's w2 energy
    pooled = float(np.exp(np.log(routed).mean()))  # the experts of a (layer, projection) share one importance
    gate = silu_gate_factor(np.array([np.sqrt(2.0 / tiny.moe_intermediate_size)]))[0]
    for e in (0, 3):
        assert imp[f"layers.0.ffn.experts.{e}.w2"] == pytest.approx(0.7 * pooled / total)
        assert imp[f"layers.0.ffn.experts.{e}.w3"] == pytest.approx(0.7 * pooled / total)
        assert imp[f"layers.0.ffn.experts.{e}.w1"] == pytest.approx(0.7 * pooled / total * gate)
        assert imp[f"layers.1.ffn.experts.{e}.w2"] == pytest.approx(5.0 * pooled / total)
    assert imp["layers.0.ffn.shared_experts.w2"] == pytest.approx(0.7 * 2.0 / total)
    for key in ("layers.0.attn.wq_a", "layers.0.attn.wo_b", "layers.2.attn.indexer.wq_b"):
        assert imp[key] == pytest.approx(0.3)
    assert imp["layers.1.attn.wkv"] == pytest.approx(2.0)
    assert imp["layers.1.engram.wkv"] == imp["layers.4.engram.wkv"] == ENGRAM_GAIN  # straight into the streams
    # proxy: the table times the LDLQ factor; cost: importance x proxy bent around K 3
    row = sens.keys.index("layers.0.attn.wo_b")
    proxy = 0.5 * model_proxy(sens.rates)
    ref = proxy[sens.rates.index(REFERENCE_RATE)]
    assert np.allclose(sens.proxy[row], proxy)
    assert np.allclose(sens.cost[row], 0.3 * ref * (proxy / ref) ** EXPONENT)
    assert sens.cost[row, sens.rates.index(3.0)] == pytest.approx(0.3 * ref)  # first order at the reference
    assert np.all(np.diff(sens.cost[row]) < 0)
    (alias,) = sens.aliases
    assert (alias.expert, alias.warm, alias.layer) == ("layers.0.ffn.experts.1", "layers.0.ffn.experts.0", 0)
    # an alias is priced by the cold expert's own routed share, not the pooled importance
    assert alias.cost == pytest.approx(0.7 * routed[1] / total * ref * (0.8 / ref) ** EXPONENT)
    assert alias.relative_share == pytest.approx(200 / np.mean([100.0 * (e + 1) for e in range(experts)]))
    assert not sens.synthetic and sens.measured == 0


def test_measured_proxies_replace_the_model_and_keep_its_shape(tiny):
    rates = rate_grid("mul1")
    key = "layers.3.ffn.experts.2.w1"
    sens = sensitivity(tiny, hand_summary(tiny), measured={key: {2: 0.05, 4.0: 0.004}})
    row = sens.proxy[sens.keys.index(key)]
    model = model_proxy(rates)
    assert row[rates.index(2.0)] == pytest.approx(0.05) and row[rates.index(4.0)] == pytest.approx(0.004)
    # outside the measured rates the model's slope carries on from the nearest measurement
    assert row[rates.index(8.0)] / row[rates.index(4.0)] == pytest.approx(model[rates.index(8.0)] / model[rates.index(4.0)])
    assert row[rates.index(1.0)] / row[rates.index(2.0)] == pytest.approx(model[rates.index(1.0)] / model[rates.index(2.0)])
    assert row[rates.index(4.0)] < row[rates.index(3.0)] < row[rates.index(2.0)]
    assert sens.measured == 1
    untouched = sens.proxy[sens.keys.index("layers.3.ffn.experts.2.w3")]
    assert np.allclose(untouched, 0.5 * model)


def test_summary_that_does_not_match_the_model(tiny):
    summary = hand_summary(tiny)
    del summary.tensors["layers.2.ffn.experts.1.w2"]
    with pytest.raises(UserError, match="no statistics for layers.2.ffn.experts.1.w2"):
        sensitivity(tiny, summary)
    summary = hand_summary(tiny)
    summary.layers[3].expert_weight = summary.layers[3].expert_weight[:-1]
    with pytest.raises(UserError, match="layer 3 has 7 experts"):
        sensitivity(tiny, summary)
    summary = hand_summary(tiny)
    summary.layers.pop()
    with pytest.raises(UserError, match="no routing statistics for layer 9"):
        sensitivity(tiny, summary)
    with pytest.raises(UserError, match="not a budgeted target"):
        sensitivity(tiny, hand_summary(tiny), measured={"head": {4: 0.01}})


def test_synthetic_summary_follows_the_field(v41, tmp_path):
    summary = synthetic_summary(v41, seed=3)
    assert summary.synthetic and summary.source_fingerprint.startswith("synthetic")
    assert {t.key for t in targets(v41) if t.budgeted} <= set(summary.tensors)
    dead = [sum(1 for c in layer.expert_tokens if c < 64) for layer in summary.layers]
    assert sum(dead[:20]) < sum(dead[30:]) and max(dead[35:]) >= 10
    gains = [layer.ffn_gain for layer in summary.layers]
    assert min(gains[:12]) > 3 and max(gains[36:]) < 0.3 and 0.5 < gains[25] < 2
    for layer in summary.layers:
        t = np.array(layer.expert_tokens)
        n_eff = t.sum() ** 2 / (t ** 2).sum()
        assert 40 < n_eff < 260  # ref: 56-197 of 384
        assert all(layer.expert_tokens[c] < 0.1 * t.mean() for c in layer.alias_candidates)
    assert synthetic_summary(v41, seed=3).layers[5].expert_tokens == summary.layers[5].expert_tokens
    back = CalibrationSummary.load(summary.save(tmp_path / "s.json"))
    assert back.synthetic and back.layers[39].alias_candidates == summary.layers[39].alias_candidates


def test_real_shape_is_vectorised(v41, monkeypatch):
    """The real shape's 46,421 targets go through each array step once (counted calls, not seconds:
    a per-target call of the gate factor or the rate table is what would make it slow)."""
    import quantizer.plan.sensitivity as module

    targets(v41)  # the layout is cached once per shape
    summary = synthetic_summary(v41)
    calls = {"silu_gate_factor": [], "model_proxy": [], "bent_cost": []}
    for name, sizes in calls.items():
        def counted(*args, _real=getattr(module, name), _sizes=sizes):
            _sizes.append(np.size(args[0]))
            return _real(*args)
        monkeypatch.setattr(module, name, counted)
    sens = sensitivity(v41, summary)
    assert sens.proxy.shape == (46_421, 11) and sens.cost.shape == (46_421, 11)  # 11 compressor and indexer.wk targets
    assert sum(1 for k in sens.keys if ".ffn.experts." in k) == 46_080
    assert np.all(np.isfinite(sens.cost)) and np.all(sens.importance >= 0)
    gates = sum(1 for t in targets(v41) if t.budgeted and t.proj == "w1" and t.group in (ROUTED, SHARED))
    assert calls["silu_gate_factor"] == [gates] and gates > 40 * 256  # every expert's gate in one call
    assert calls["model_proxy"] == [11, 11]  # the rate table over the whole grid: the model, measured proxies
    # one scalar price per alias option; otherwise only arrays of every target (the two `sens.cost` above)
    assert sorted(calls["bent_cost"]) == [1] * len(sens.aliases) + [46_421] * 2 and sens.aliases
