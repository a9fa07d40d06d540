"""The calibrate stage on the tiny V4.1 checkpoint: Hessians equal a direct computation from the whole
model's linear inputs, shared inputs share one H, routing counts add up, and an expert the router
never picks still gets a usable H and an alias candidate."""

from __future__ import annotations

import re
import shutil
import struct

import numpy as np
import pytest
import torch

from quantizer.calibrate import CalibrationSettings, CalibrationSummary, HessianStore, calibrate
from quantizer.calibrate.duration import CalibrationRate, calibration_flops, calibration_line
from quantizer.calibrate.storage import (
    CALIBRATION_DIR,
    SUMMARY_FILE,
    HessianRecord,
    layer_file,
    pack_hessian,
    read_meta,
    unpack_hessian,
    write_stats_file,
)
from quantizer.checkpoint.safetensors_file import read_header, read_tensor
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import build_parser
from quantizer.codec.ldlq import finalize_hessian
from quantizer.errors import UserError
from quantizer.model.flops import model_flops
from quantizer.model.hooks import ForwardHooks
from quantizer.model.targets import DRAFT, ROUTED, targets
from quantizer.model.transformer import DeepseekModel
from quantizer.quantize.settings import QuantizeSettings
from quantizer.shipped import shipped

DEAD_LAYER, DEAD_EXPERT = 2, 5  # the router's selection bias keeps this expert from ever being picked
ROWS, COLS = 3, 24


def _with_dead_expert(tiny, out):
    """A copy of the checkpoint whose layer DEAD_LAYER never routes to DEAD_EXPERT (F32 bias patched in place)."""
    shutil.copytree(tiny, out)
    entry = Checkpoint.open(out).entry(f"layers.{DEAD_LAYER}.ffn.gate.bias")
    with open(entry.path, "r+b") as f:
        f.seek(entry.offset + 4 * DEAD_EXPERT)
        f.write(struct.pack("<f", -1e4))
    return out


@pytest.fixture(scope="module")
def ck(tiny_v41, tmp_path_factory):
    return Checkpoint.open(_with_dead_expert(tiny_v41, tmp_path_factory.mktemp("ck") / "dead"))


@pytest.fixture(scope="module")
def rows():
    return torch.from_numpy(np.random.default_rng(7).integers(3, 4096, size=(ROWS, COLS)))


def _run(ck, rows, work, **settings):
    result = calibrate(ck, rows, work, CalibrationSettings(**settings), progress=False)
    return result, HessianStore(work, ck)


@pytest.fixture(scope="module")
def default_run(ck, rows, tmp_path_factory):
    return _run(ck, rows, tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def forward(ck, rows):
    """The whole model's linear inputs and routing on the same rows (top-k only)."""
    model = DeepseekModel.from_checkpoint(ck)
    inputs: dict[str, torch.Tensor] = {}
    routing = {}
    hooks = ForwardHooks(linear_input=lambda name, x: inputs.setdefault(name, x.clone()),
                         routing=lambda event: routing.setdefault(event.layer, event))
    with torch.no_grad():
        model(rows, hooks)
    return model, inputs, routing


def _mean(store, key):
    h, count = store.hessian(key)
    return h / count, count


def _direct(x, size):
    x = x.reshape(-1, size).double()
    return x.T @ x / x.shape[0]


def _close(a, b):
    scale = b.abs().max()
    assert (a.double() - b.double()).abs().max() <= 1e-4 * scale + 1e-9


def _calibrated_targets(cfg):
    return [t for t in targets(cfg) if t.group != DRAFT]


def test_every_target_has_a_symmetric_psd_hessian_shared_where_the_input_is(ck, default_run):
    _, store = default_run
    for t in _calibrated_targets(ck.config):
        h, count = _mean(store, t.key)
        assert h.shape == (t.in_features, t.in_features) and count >= 1, t.key
        assert torch.isfinite(h).all() and torch.equal(h, h.T), t.key
        eig = torch.linalg.eigvalsh(h.double())
        assert eig.min() >= -1e-3 * eig.max(), t.key
    # the drafter is not calibrated: its linears, wo_a slices included, quantize without H
    assert store.hessian("mtp.0.attn.wo_a.slice.0") is None and store.hessian("mtp.0.ffn.experts.1.w2") is None
    layer = "layers.3"
    assert store.hessian(f"{layer}.attn.wq_a") is store.hessian(f"{layer}.attn.wkv")
    assert store.hessian("layers.2.attn.wq_b") is store.hessian("layers.2.attn.indexer.wq_b")
    shared = store.hessian(f"{layer}.ffn.shared_experts.w1")
    assert store.hessian(f"{layer}.ffn.shared_experts.w3") is shared
    # the default (gate2): each routed expert's gate and up share its own H, not the shared expert's
    for e in range(ck.config.n_routed_experts):
        own = store.hessian(f"{layer}.ffn.experts.{e}.w1")
        assert store.hessian(f"{layer}.ffn.experts.{e}.w3") is own and own is not shared
    assert not torch.equal(store.hessian(f"{layer}.ffn.experts.0.w1")[0], store.hessian(f"{layer}.ffn.experts.1.w1")[0])
    assert store.hessian(f"{layer}.ffn.experts.0.w2") is not store.hessian(f"{layer}.ffn.experts.1.w2")


def test_hessians_equal_a_direct_computation_from_the_whole_model(ck, rows, default_run, forward):
    _, store = default_run
    model, inputs, routing = forward
    cfg = ck.config
    tokens = ROWS * COLS
    for t in _calibrated_targets(cfg):
        if t.group == ROUTED:
            continue
        x = inputs[f"{t.key}.weight"]
        h, count = _mean(store, t.key)
        # every token, except the indexer's wk, which reads one compressed entry per `ratio` tokens
        expected = ROWS * (COLS // cfg.ratio(t.layer)) if t.proj == "wk" else tokens
        assert count == expected, t.key
        _close(h, _direct(x, t.in_features))  # wo_a: the mean of its slices = over tokens and groups
    for layer in (1, 4):  # the shared expert's w1/w3 read the MoE input, every token
        _close(_mean(store, f"layers.{layer}.ffn.shared_experts.w1")[0],
               _direct(inputs[f"layers.{layer}.ffn.gate.weight"], cfg.hidden_size))
    # an expert no token reached: its own gate/up H (gate2, the default) is its prior alone, that same
    # mean (to the float16 its correlations are stored in)
    dead = _mean(store, f"layers.{DEAD_LAYER}.ffn.experts.{DEAD_EXPERT}.w1")[0]
    direct = _direct(inputs[f"layers.{DEAD_LAYER}.ffn.gate.weight"], cfg.hidden_size)
    assert (dead.double() - direct.double()).abs().max() <= 1e-3 * direct.abs().max()
    wo_a = "layers.2.attn.wo_a"
    size = store.hessian(wo_a)[0].shape[0]
    _close(_mean(store, f"{wo_a}.slice.1")[0], _direct(inputs[f"{wo_a}.weight"][..., 1, :], size))

    # a routed down projection: routed tokens weighted by w^2 plus the all-token prior of prior_tokens
    prior = CalibrationSettings().prior_tokens
    for layer, e in ((3, 2), (DEAD_LAYER, DEAD_EXPERT)):
        event = routing[f"layers.{layer}"]
        x = inputs[f"layers.{layer}.ffn.gate.weight"]
        hidden = model.layers[layer].ffn.experts[e].hidden(x, None).double()
        w2 = event.weights.double().square()
        routed = (w2 * (event.expert_ids == e)).sum(1)
        beta = prior * w2.mean() / tokens
        expected = (hidden.T * (routed + beta)) @ hidden / (routed.sum() + prior * w2.mean())
        h, count = _mean(store, f"layers.{layer}.ffn.experts.{e}.w2")
        assert count == round(int((event.expert_ids == e).sum()) + prior)
        _close(h, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_stored_hessian_unpacks_to_its_definition_bit_for_bit(dtype):
    """H = D^1/2 C D^1/2 with C the symmetric matrix of the stored triangle: the quantize stage's codes
    depend on every bit of it."""
    n = 37
    x = torch.randn(n, 3 * n, generator=torch.Generator().manual_seed(5))
    h = x @ x.T / x.shape[1]
    h[:, 4] = h[4, :] = 0  # a dead channel: diagonal 0, its correlations 0
    parts = pack_hessian("g", h, dtype)
    diag, corr = parts["g.diag"], parts["g.corr"]
    rows, cols = torch.triu_indices(n, n)
    c = torch.zeros(n, n)
    c[rows, cols] = corr.float()
    c[cols, rows] = corr.float()
    s = diag.sqrt()
    unpacked = unpack_hessian(diag, corr)
    assert torch.equal(unpacked, c * (s.unsqueeze(1) * s.unsqueeze(0)))
    assert torch.equal(unpacked, unpacked.T)
    assert torch.allclose(unpacked, h, rtol=0, atol=1e-3 * h.abs().max().item())
    with pytest.raises(ValueError, match="37 channels has 703 entries, not 702"):
        unpack_hessian(diag, corr[:-1])


def test_a_stored_triangle_of_the_wrong_length_is_refused_with_the_file_and_the_fix(ck, default_run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(default_run[1].dir.parent, work)
    path = work / CALIBRATION_DIR / layer_file(0)
    header = read_header(path)
    parts = {name: read_tensor(entry) for name, entry in header.tensors.items()}
    group = next(name for name in parts if name.endswith(".corr")).removesuffix(".corr")
    parts[f"{group}.corr"] = parts[f"{group}.corr"][:-1]
    write_stats_file(path, parts, read_meta(path))
    with pytest.raises(UserError, match=rf"{layer_file(0)}: Hessian '{re.escape(group)}': .* entries, not .*; "
                                        rf"delete .* and calibrate again"):
        HessianStore(work, ck).mean(group)


def test_the_hessian_record_round_trips_as_jobs_store_it_and_a_malformed_one_is_one_line(default_run):
    result, store = default_run
    record = store.record
    stored = {"fingerprint": result.fingerprint, "rows": ROWS, "cols": COLS, "expert_inputs": True}  # gate2
    assert record.to_dict() == stored == QuantizeSettings(hessians=record).record()["calibration"]
    assert HessianRecord.from_dict(stored, "job.json") == record
    shared = HessianRecord(result.fingerprint, ROWS, COLS)  # --expert-hessians shared: no key, as before it existed
    assert shared.to_dict() == {"fingerprint": result.fingerprint, "rows": ROWS, "cols": COLS}
    assert HessianRecord.from_dict(shared.to_dict(), "job.json") == shared
    for bad in ({"fingerprint": "sha256:x", "rows": 2}, {**stored, "rows": "2"}, {**stored, "rows": True},
                {**stored, "tokens": 6}, ["sha256:x", 2, 3]):
        with pytest.raises(UserError) as e:
            HessianRecord.from_dict(bad, "manifest.json settings")
        assert len(str(e.value).splitlines()) == 1, bad
        assert str(e.value).startswith("manifest.json settings: not a Hessian record {fingerprint, rows, cols"), bad


def test_routing_counts_sum_to_rows_times_cols_times_k(ck, default_run, forward):
    result, _ = default_run
    _, _, routing = forward
    k = ck.config.experts_per_token
    assert len(result.summary.layers) == ck.config.num_layers
    for stats in result.summary.layers:
        assert sum(stats.expert_tokens) == ROWS * COLS * k
        ids = routing[f"layers.{stats.layer}"].expert_ids
        assert stats.expert_tokens == torch.bincount(ids.flatten(), minlength=len(stats.expert_tokens)).tolist()
        assert all(w >= 0 for w in stats.expert_weight)
        assert stats.attn_gain > 0 and stats.ffn_gain > 0


def test_a_never_routed_expert_gets_a_usable_hessian_and_an_alias(default_run):
    result, store = default_run
    stats = result.summary.layer(DEAD_LAYER)
    assert stats.expert_tokens[DEAD_EXPERT] == 0
    h, count = store.hessian(f"layers.{DEAD_LAYER}.ffn.experts.{DEAD_EXPERT}.w2")
    assert count == CalibrationSettings().prior_tokens
    damped = finalize_hessian(h, count)
    assert damped is not None and torch.linalg.cholesky_ex(damped)[1] == 0
    warm, error = stats.alias_candidates[DEAD_EXPERT]
    assert warm != DEAD_EXPERT and stats.expert_tokens[warm] > 0 and 0 < error < float("inf")
    assert set(stats.alias_candidates) <= {e for e, n in enumerate(stats.expert_tokens)
                                           if n < 0.25 * sum(stats.expert_tokens) / len(stats.expert_tokens)}


def test_summary_loads_back_with_statistics_for_every_calibrated_target(ck, default_run, tmp_path):
    result, _ = default_run
    loaded = CalibrationSummary.load(result.directory / SUMMARY_FILE)
    assert loaded == result.summary
    assert set(loaded.tensors) == {t.key for t in _calibrated_targets(ck.config)}
    cfg = ck.config
    for key, stats in loaded.tensors.items():
        assert stats.out_energy > 0 and 0 < stats.ldlq_factor <= 1, key
    layer = loaded.layer(3)
    e = 2
    assert loaded.tensors[f"layers.3.ffn.experts.{e}.w1"].tokens == layer.expert_tokens[e]
    assert loaded.tensors[f"layers.3.ffn.experts.{e}.w2"].tokens == layer.expert_tokens[e]
    assert loaded.tensors["layers.3.attn.wq_a"].tokens == loaded.tensors["head"].tokens == ROWS * COLS
    assert (loaded.source_fingerprint, loaded.rows, loaded.cols) == (result.summary.source_fingerprint, ROWS, COLS)
    assert cfg.num_layers == len(loaded.layers)


def test_out_energy_is_trace_of_w_h_wt(ck, default_run, forward):
    result, store = default_run
    model, _, _ = forward
    key = "layers.3.attn.wo_b"
    w = model.layers[3].attn.wo_b.weight.detach().double()
    h, _ = _mean(store, key)
    expected = float(torch.trace(w @ h.double() @ w.T))
    assert result.summary.tensors[key].out_energy == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow  # a calibration of its own, without all experts (31-40 s on 2 busy cores)
def test_without_all_experts_routed_downs_use_routed_tokens_only_at_prior_zero(ck, rows, default_run, forward,
                                                                              tmp_path):
    _, default_store = default_run
    model, inputs, routing = forward
    result, store = _run(ck, rows, tmp_path, all_experts=False, prior_tokens=0)
    layer, e = 3, 2
    event = routing[f"layers.{layer}"]
    x = inputs[f"layers.{layer}.ffn.gate.weight"]
    hidden = model.layers[layer].ffn.experts[e].hidden(x, None).double()
    w2 = (event.weights.double().square() * (event.expert_ids == e)).sum(1)
    _close(_mean(store, f"layers.{layer}.ffn.experts.{e}.w2")[0], (hidden.T * w2) @ hidden / w2.sum())
    assert store.hessian(f"layers.{DEAD_LAYER}.ffn.experts.{DEAD_EXPERT}.w2") is None  # nothing to go on
    # all-experts capture changes no Hessian outside the routed experts and no routing
    for key in ("layers.3.ffn.shared_experts.w1", "layers.3.attn.wq_a"):
        assert torch.equal(store.hessian(key)[0], default_store.hessian(key)[0]), key
    assert [s.expert_tokens for s in result.summary.layers] == [s.expert_tokens for s in default_run[0].summary.layers]


@pytest.mark.slow  # a calibration of its own, without all experts (31-40 s on 2 busy cores)
def test_without_all_experts_a_sampled_prior_keeps_a_dead_expert_usable(ck, rows, tmp_path):
    _, store = _run(ck, rows, tmp_path, all_experts=False)
    h, count = store.hessian(f"layers.{DEAD_LAYER}.ffn.experts.{DEAD_EXPERT}.w2")
    damped = finalize_hessian(h, count)
    assert damped is not None and torch.linalg.cholesky_ex(damped)[1] == 0
    assert (tmp_path / CALIBRATION_DIR / SUMMARY_FILE).exists()


def test_default_rows_that_the_text_cannot_fill_say_so_and_asked_rows_do_not(tiny_v4, tmp_path, capsys):
    from quantizer.calibrate.rows import calibration_rows
    from quantizer.calibrate.settings import DEFAULT_ROWS

    ck = Checkpoint.open(tiny_v4)
    stream = tmp_path / "ids.npy"
    np.save(stream, np.arange(3 * 64, dtype=np.int64) % 50 + 3)  # three rows of 64 tokens
    rows = calibration_rows(ck, None, str(stream), None, 64)
    err = capsys.readouterr().err
    assert rows.shape == (3, 64)
    assert f"calibrate: 3 rows of 64 tokens, all the token file holds (the default takes up to {DEFAULT_ROWS})" in err
    assert "lowers its KL" in err
    assert calibration_rows(ck, None, str(stream), 2, 64).shape == (2, 64)
    assert capsys.readouterr().err.strip() == "calibrate: 2 rows of 64 tokens"


def test_build_and_calibrate_state_the_same_calibration_defaults():
    from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS

    assert (DEFAULT_ROWS, DEFAULT_COLS) == (250, 2048)  # exllamav3's calibration
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, rows, cols in (("build", "--calib-rows", "--calib-cols"), ("calibrate", "--rows", "--cols")):
        helps = {a.option_strings[0]: a.help for a in sub[command]._actions if a.option_strings}
        assert f"up to {DEFAULT_ROWS}," in helps[rows] and helps[cols].endswith(f"else {DEFAULT_COLS})")


def test_a_calibration_states_its_rows_and_time_first_and_says_when_it_is_reused(ck, rows, tmp_path, capsys):
    """Before any layer: the rows and the time the measured rate gives (calibrate/duration.py); a rerun
    of the same rows in the same work directory says it reuses them instead of what a run would need."""
    _run(ck, rows, tmp_path)
    first = capsys.readouterr().err.splitlines()
    stated = calibration_line(ck.config, ROWS, COLS, CalibrationSettings())
    assert stated in first and first[first.index(stated) + 1].startswith("calibrate needs ~")
    _run(ck, rows, tmp_path)
    again = capsys.readouterr().err
    assert f"calibrate: reusing the finished calibration of {ROWS} rows x {COLS} tokens in {tmp_path / CALIBRATION_DIR}" \
        in again and "calibrate needs" not in again


def test_the_stated_calibration_time_is_the_benchs_measured_rate():
    """The estimate is the pass's model FLOPs over its rate plus the unit KL probe's (where it runs) over
    its own, as bench/calibrate_cpu.py measured them; a device without a measured rate gets the rows alone."""
    cfg = Checkpoint.open(shipped("small_model")).config
    rate, settings = CalibrationRate.load("cpu"), CalibrationSettings()
    assert rate is not None and min(rate.pass_flops_per_s, rate.probe_flops_per_s) > 0
    probe = calibration_flops(cfg, 8, 2048, settings)[1]
    assert probe > model_flops(cfg, 8, 512)  # one forward of 8 x 512 tokens, then the layers after each unit
    for rows in (8, 37):
        assert calibration_flops(cfg, rows, 2048, CalibrationSettings(measure_kl=False)) == (model_flops(cfg, rows, 2048), 0)
        flops = calibration_flops(cfg, rows, 2048, settings)
        assert flops == (model_flops(cfg, rows, 2048), probe)  # the probe takes 8 rows at most
        seconds = flops[0] / rate.pass_flops_per_s + flops[1] / rate.probe_flops_per_s
        assert rate.seconds(flops) == pytest.approx(seconds)
        line = calibration_line(cfg, rows, 2048, settings)
        assert line.startswith(f"calibrate: {rows} rows x 2,048 tokens, about {seconds:.0f} s at the rate measured on ")
    assert calibration_line(cfg, 8, 2048, CalibrationSettings(device="cuda")) == (
        "calibrate: 8 rows x 2,048 tokens (no measured calibration rate for --device cuda, so no time estimate)")
