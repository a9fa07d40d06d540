"""--expert-hessians on the tiny V4.1 checkpoint: each routed expert's gate/up and down Hessians equal a
direct computation from the tokens routed to it and their routing weights (plus the all-token prior),
the setting is recorded and moves the quantize cache's unit digests, and an unknown name is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quantizer.calibrate import CalibrationSettings, HessianStore, calibrate
from quantizer.calibrate.stage import job_record
from quantizer.calibrate.storage import CALIBRATION_DIR, JOB_FILE, HessianRecord
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.codec.ldlq import finalize_hessian
from quantizer.contract.pack_spec import pack_spec
from quantizer.model.hooks import ForwardHooks
from quantizer.model.transformer import DeepseekModel
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize.linears import plan_units
from quantizer.quantize.settings import QuantizeSettings

ROWS, COLS = 3, 24
WEIGHTING = "gate"  # g^1: a power other than the default's 2, so a wrong power cannot pass


@pytest.fixture(scope="module")
def weighted(tiny_v41, tmp_path_factory):
    """(checkpoint, token rows, work directory, store) of one calibration with WEIGHTING."""
    work, ck = tmp_path_factory.mktemp("work"), Checkpoint.open(tiny_v41)
    rows = torch.from_numpy(np.random.default_rng(11).integers(3, 4096, size=(ROWS, COLS)))
    settings = CalibrationSettings(expert_hessians=WEIGHTING, measure_kl=False, expert_hessian_dtype="float32",
                                   row_chunk=1)  # one chunk per row: the experts' sums run over kept chunks
    calibrate(ck, rows, work, settings, progress=False)  # float32: the formula checked, not the storage
    return ck, rows, work, HessianStore(work, ck)


def _mean(store, key):
    h, count = store.hessian(key)
    return h.double() / count, count


def test_routed_expert_hessians_equal_the_gate_weighted_routed_tokens_plus_the_prior(weighted):
    ck, rows, _, store = weighted
    model = DeepseekModel.from_checkpoint(ck)
    inputs, routing = {}, {}
    hooks = ForwardHooks(linear_input=lambda name, x: inputs.setdefault(name, x.clone()),
                         routing=lambda event: routing.setdefault(event.layer, event))
    with torch.no_grad():
        model(rows, hooks)
    prior = CalibrationSettings().prior_tokens
    tokens = ROWS * COLS
    for layer in (1, 3):
        event = routing[f"layers.{layer}"]
        x = inputs[f"layers.{layer}.ffn.gate.weight"].double()  # the MoE input, every token
        g = event.weights.double()
        all_tokens = x.T @ x / tokens
        for e in range(ck.config.n_routed_experts):
            routed = (g * (event.expert_ids == e)).sum(1)  # g_te, 0 where e was not picked
            weight = routed.sum() + prior * g.mean()
            own = ((x.T * routed) @ x + prior * g.mean() * all_tokens) / weight
            h, count = _mean(store, f"layers.{layer}.ffn.experts.{e}.w1")
            assert count == round(int((event.expert_ids == e).sum()) + prior)
            assert (h - own).abs().max() <= 1e-4 * own.abs().max(), (layer, e)
            assert store.hessian(f"layers.{layer}.ffn.experts.{e}.w3") is store.hessian(f"layers.{layer}.ffn.experts.{e}.w1")
            damped = finalize_hessian(*store.hessian(f"layers.{layer}.ffn.experts.{e}.w1"))
            assert damped is not None and torch.linalg.cholesky_ex(damped)[1] == 0
            # the down projection: the same weights, its prior over every token's hidden
            hidden = model.layers[layer].ffn.experts[e].hidden(x.float(), None).double()
            down = (hidden.T * (routed + prior * g.mean() / tokens)) @ hidden / weight
            h, _ = _mean(store, f"layers.{layer}.ffn.experts.{e}.w2")
            assert (h - down).abs().max() <= 1e-4 * down.abs().max(), (layer, e)
        assert not torch.equal(store.hessian(f"layers.{layer}.ffn.experts.0.w1")[0],
                               store.hessian(f"layers.{layer}.ffn.experts.1.w1")[0])
        # the shared expert still reads the all-token MoE input
        h, _ = _mean(store, f"layers.{layer}.ffn.shared_experts.w1")
        assert (h - all_tokens).abs().max() <= 1e-4 * all_tokens.abs().max()


def test_the_setting_is_recorded_and_no_unit_digest_survives_it(weighted, tmp_path):
    ck, rows, work, store = weighted
    job = json.loads((work / CALIBRATION_DIR / JOB_FILE).read_text())
    assert job["settings"]["expert_hessians"] == WEIGHTING
    default = job_record(ck, rows, CalibrationSettings(measure_kl=False), tmp_path)
    assert default["settings"]["expert_hessians"] == "gate2" and default["fingerprint"] != store.record.fingerprint
    plan = uniform_plan(ck.config, 3.0)
    spec = pack_spec(ck.config, plan)

    def digests(hessians):
        job = QuantizeSettings(hessians=hessians).record()
        return {u.name: u.digest for u in plan_units(spec, plan.codebook, job)}

    mine = digests(store.record)
    theirs = digests(HessianRecord(default["fingerprint"], ROWS, COLS))
    assert mine.keys() == theirs.keys() and all(mine[k] != theirs[k] for k in mine)


@pytest.mark.parametrize("command", ["calibrate", "build"])
def test_an_unknown_weighting_is_one_line_and_exit_2(tiny_v41, tmp_path, capsys, command):
    extra = ["--out", str(tmp_path / "pack"), "--bpw", "3"] if command == "build" else []
    argv = [command, str(tiny_v41), "--work", str(tmp_path / "w"), "--expert-hessians", "gate3", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--expert-hessians 'gate3': unknown" in err and "gate2" in err, err
    assert not (tmp_path / "w").exists() and not (tmp_path / "pack").exists()
