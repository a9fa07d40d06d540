"""What calibrate states it needs against the tensor bytes a real calibration holds (bench/live_bytes.py
sums every live storage exactly), on the CPU: the same code and tensors as on a GPU, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from script_module import script_module

from quantizer.calibrate import CalibrationSettings, calibration_needs
from quantizer.calibrate.groups import layer_groups
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.model.streaming import block_weight_bytes
from quantizer.tiny.make import random_values
from quantizer.tiny.native_writer import write_native_checkpoint

BENCH = Path(__file__).resolve().parents[1] / "bench" / "calibrate_memory.py"


@pytest.fixture(scope="module")
def bench():
    with script_module(BENCH) as module:
        yield module


@pytest.fixture(scope="module")
def one_layer(bench, tmp_path_factory):
    """The tiny V4.1 cut to one Engram layer of 8 experts (bench/calibrate_memory.py's slice)."""
    raw = bench.slice_config(1, 8, 1, base="tiny-v41.json")
    out = tmp_path_factory.mktemp("slice") / "src"
    write_native_checkpoint(out, raw, random_values(ModelConfig.from_dict(raw), torch.Generator().manual_seed(0)), 2)
    return Checkpoint.open(out)


def _tokens(ck: Checkpoint, rows: int, cols: int) -> torch.Tensor:
    return torch.randint(3, ck.config.vocab_size, (rows, cols), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("experts", ["shared", "gate2"])
def test_calibration_estimate_is_within_a_quarter_of_the_live_bytes(bench, one_layer, tmp_path, experts):
    cfg = one_layer.config
    settings = CalibrationSettings(measure_kl=False, row_chunk=2, expert_hessians=experts)
    needs = calibration_needs(cfg, 2, 256, settings)
    live = bench.measure(one_layer, _tokens(one_layer, 2, 256), tmp_path / "work", settings)
    measured, estimated = live.peak["cpu"].bytes, bench.metered_estimate(needs)
    assert 0.75 <= estimated / measured <= 1.33, (estimated, measured, needs.stream.moment)
    seen = bench.by_moment(needs)
    moments = ("loading", "engram", "attention", "moe", "site gains", "finishing", "head")
    for moment in moments + (("expert inputs",) if settings.expert_inputs else ()):
        got = live.phases[moment]["cpu"].bytes
        assert 0.75 <= seen[moment] / got <= 1.33, (moment, seen[moment], got)
    # while the MoE runs, the block's weights and the collector's float64 sums are resident, to the byte;
    # with the experts' own gate/up Hessians too, none of theirs: they are made one at a time afterwards
    moe = bench.parts(live.phases["moe"]["cpu"])
    assert moe["weights"] == block_weight_bytes(cfg, settings.dtype)["layers.0"]
    sums = sum(8 * g.size ** 2 for g in layer_groups(cfg, 0))
    # + per-expert routed tokens, sums of w^2 and of w^p (collect.py), and the site energies
    assert moe["Hessian sums"] == sums + 3 * 8 * cfg.experts_in("layers") + 2 * 2 * 8
    assert needs.device >= estimated and needs.ram("cpu") >= needs.device


def test_streamed_forward_estimate_is_within_a_quarter(bench, one_layer):
    """ppl and eval stream the same blocks without Hessians (LayerStreamer.estimate)."""
    live, estimate = bench.measure_streamer(one_layer, _tokens(one_layer, 2, 256), CalibrationSettings(), 2, ("cpu",))
    assert 0.75 <= estimate.total / live.peak["cpu"].bytes <= 1.33, (estimate, live.peak["cpu"].bytes)
