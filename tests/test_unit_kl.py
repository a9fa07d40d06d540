"""Measured unit KL: the probe reruns only from the perturbed layer and agrees with a whole forward,
the KL grows with the noise, calibrate records it where the model fits (and not when told not to),
announcing the pass with its estimate before a bar over its units, and the allocator's modelled cost of
a unit at the probe's noise equals the KL measured for it."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

from quantizer.calibrate import CalibrationSettings, HessianStore, calibrate
from quantizer.calibrate.duration import unit_kl_line
from quantizer.calibrate.summary import KL_UNITS, MEASURED_KL, REFERENCE_RATE, STREAM_ENERGY, kl_unit
from quantizer.calibrate.unit_kl import KLProbe, hessian_noise, unit_keys
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.model.hooks import ForwardHooks
from quantizer.model.targets import targets
from quantizer.model.transformer import DeepseekModel
from quantizer.plan.sensitivity import bent_cost, sensitivity

ROWS, COLS = 3, 24


@pytest.fixture(scope="module")
def ck(tiny_v41):
    return Checkpoint.open(tiny_v41)


@pytest.fixture(scope="module")
def rows():
    return torch.from_numpy(np.random.default_rng(3).integers(3, 4096, size=(ROWS, COLS)))


@pytest.fixture(scope="module")
def measured(ck, rows, tmp_path_factory):
    """The calibration with its unit KL, and what it printed (its bars included, as a user sees them)."""
    work, err = tmp_path_factory.mktemp("work"), io.StringIO()
    with contextlib.redirect_stderr(err):
        result = calibrate(ck, rows, work, CalibrationSettings(measure_kl=True, kl_rows=2, kl_cols=COLS))
    return result.summary, HessianStore(work, ck), err.getvalue()


@pytest.fixture(scope="module")
def model(ck):
    return DeepseekModel.from_checkpoint(ck)


@torch.no_grad()
def _kl_whole_forward(model, tokens, replaced):
    """KL(native || replaced) per token from two full forwards (what the probe must reproduce)."""
    native = torch.log_softmax(model(tokens).float(), -1)
    hooks = ForwardHooks(weight_override=lambda name, _w: replaced.get(name))
    perturbed = torch.log_softmax(model(tokens, hooks=hooks).float(), -1)
    return float((native.exp() * (native - perturbed)).sum(-1).mean().detach())


def test_probe_matches_a_whole_forward_and_is_zero_without_change(model, rows):
    tokens = rows[:2]
    probe = KLProbe(model, tokens)
    name = "layers.2.ffn.shared_experts.w2.weight"
    w = dict(model.named_parameters())[name].data
    noisy = {name: w + 0.05 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))}
    assert probe.kl({name: w.clone()}) == pytest.approx(0.0, abs=1e-7)
    assert probe.kl(noisy) == pytest.approx(_kl_whole_forward(model, tokens, noisy), rel=1e-3)
    with pytest.raises(ValueError, match="no trunk weight"):
        probe.kl({"head.weight": w})


@pytest.mark.slow  # `measured`: a calibration with every unit's KL probed (99 s on 2 busy cores)
def test_kl_grows_with_the_noise_level(model, rows, measured):
    _, store, _ = measured
    key = "layers.1.attn.wkv"
    h, count = store.hessian(key)
    w = dict(model.named_parameters())[key + ".weight"].data
    probe = KLProbe(model, rows[:2])
    kls = [probe.kl({key + ".weight": hessian_noise(key, w, h / count, level)}) for level in (0.01, 0.04, 0.16)]
    # Rising, though not in proportion on this random model: its near-tied routing and indexer picks
    # flip at the smallest noise already.
    assert 0 < kls[0] < kls[1] < kls[2]


@pytest.mark.slow  # `measured`: a calibration with every unit's KL probed (99 s on 2 busy cores)
def test_calibrate_records_every_layers_units(ck, measured):
    summary, _, _ = measured
    assert summary.gains == MEASURED_KL and summary.kl_relative_error > 0
    assert (summary.kl_rows, summary.kl_cols) == (2, COLS)
    units = unit_keys(ck.config)
    for layer in summary.layers:
        present = {u for (L, u) in units if L == layer.layer}
        assert set(layer.unit_kl) == present and present <= set(KL_UNITS)
        assert all(v >= 0 for v in layer.unit_kl.values())


@pytest.mark.slow  # `measured`: a calibration with every unit's KL probed (99 s on 2 busy cores)
def test_the_unit_kl_pass_is_announced_with_its_estimate_then_counts_its_units(ck, measured):
    """The probe is a phase of its own: a line with its size and the time the bench's rate gives, printed
    before the pass starts, then a bar over the units (done of all)."""
    err = measured[2]
    units = len(unit_keys(ck.config))
    line = unit_kl_line(ck.config, 2, COLS, "cpu")
    assert line.startswith(f"calibrate: unit KL of {units} layer units on 2 x {COLS} tokens, about ")
    assert line.endswith("(bench/calibrate_cpu.py)")
    announced = err.index(line + "\n")
    assert err.index("unit KL:") > announced > err.index("calibrate: 3 rows x 24 tokens")
    assert f"| {units}/{units} [" in err[announced:]  # the bar reached every unit
    assert "no time estimate" in unit_kl_line(ck.config, 2, COLS, "cuda")  # no rate measured on CUDA


def test_measurement_can_be_turned_off(ck, rows, tmp_path, capsys):
    result = calibrate(ck, rows, tmp_path, CalibrationSettings(measure_kl=False), progress=False)
    assert "unit KL" not in capsys.readouterr().err
    assert result.summary.gains == STREAM_ENERGY and all(not layer.unit_kl for layer in result.summary.layers)
    with pytest.raises(UserError, match="kl-rows"):
        CalibrationSettings(kl_rows=0)


@pytest.mark.slow  # `measured`: a calibration with every unit's KL probed (99 s on 2 busy cores)
def test_modelled_unit_cost_at_the_probe_noise_is_the_measured_kl(ck, measured):
    summary, _, _ = measured
    sens = sensitivity(ck.config, summary)
    ref = sens.rates.index(REFERENCE_RATE)
    target = {t.key: t for t in targets(ck.config)}
    by_unit: dict[tuple[int, str], float] = {}
    for key, importance, proxy in zip(sens.keys, sens.importance, sens.proxy[:, ref]):
        unit = target[key].layer, kl_unit(target[key].group)
        noise = summary.kl_relative_error * max(summary.tensors[key].ldlq_factor, 0.0)
        by_unit[unit] = by_unit.get(unit, 0.0) + float(bent_cost(importance, proxy, noise))
    for (layer, unit), cost in by_unit.items():
        kl = summary.layer(layer).unit_kl.get(unit)
        if kl:
            assert cost == pytest.approx(kl, rel=1e-6), (layer, unit)
