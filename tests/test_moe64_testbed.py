"""The 64-expert V4 testbed (`quantizer/small_model_v4_moe64`) and how bench/converter_curve.py reads a
converter curve on it.

The testbed is what issue 20's routing-dependent methods are measured on in exllamav3
(tests/gpu/test_small_v4_exllamav3.py runs it there); here: it is the shape its config says, the shape
stock exllamav3 1.6.5 runs, and as sparse as it claims.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_module import script_module

from quantizer.checkpoint.config import V4
from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.inventory.classify import check_against_config
from quantizer.model.targets import ROUTED, targets
from quantizer.shipped import model_config_path, shipped
from quantizer.textdata import shipped_tokenizer_path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "converter_curve.py"


@pytest.fixture(scope="module")
def curve_bench():
    with script_module(BENCH) as module:
        yield module


def test_the_testbed_is_its_config_with_64_experts_top6_and_no_drafter():
    root = shipped("small_model_v4_moe64")
    ck = Checkpoint.open(root)
    cfg = ck.config
    assert cfg.arch == V4 and cfg.raw == json.loads(model_config_path("small-v4-moe64.json").read_text())
    assert not check_against_config(ck)  # every tensor the layout implies, no other
    assert (cfg.n_routed_experts, cfg.experts_per_token, cfg.num_hash_layers, cfg.num_mtp_blocks) == (64, 6, 1, 0)
    assert not any(name.startswith("mtp.") for name in ck.tensors)
    dims = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.o_lora_rank, cfg.head_dim,
            cfg.index_head_dim)
    assert all(d % 128 == 0 for d in dims), dims  # exllamav3's kernels' tile
    routed = sum(t.out_features * t.in_features for t in targets(cfg) if t.group == ROUTED)
    budgeted = sum(t.out_features * t.in_features for t in targets(cfg))
    assert routed / budgeted > 0.9  # where a pack's bits go, as in the real model
    assert (root / "tokenizer.json").read_bytes() == shipped_tokenizer_path().read_bytes()
    record = json.loads((root / "training.json").read_text())
    assert record["config"] == "small-v4-moe64.json" and record["heldout_nll_native_fp8_fp4"] < 4.0


def test_the_converter_is_credited_with_its_best_pack_of_at_most_b_bits(curve_bench):
    # The converter's 2.5 bpw pack is worse than its 2.25 one (measured on the testbed): a KL between
    # them is reached at 2.25 + something on the way to 2.75, never at 2.5.
    curve = [(2.0, 0.1017), (2.25, 0.0488), (2.5, 0.0512), (2.75, 0.0298), (3.0, 0.0347), (3.25, 0.0185)]
    assert curve_bench.best_of(curve) == [(2.0, 0.1017), (2.25, 0.0488), (2.75, 0.0298), (3.25, 0.0185)]
    bits, side = curve_bench.bits_equiv(0.0430, curve)
    assert side == "" and bits == pytest.approx(2.25 + 0.5 * 0.1265 / 0.4932, abs=2e-3)
    assert curve_bench.bits_equiv(0.2, curve) == (2.0, "<") and curve_bench.bits_equiv(0.01, curve) == (3.25, ">")
    monotone = [(2.0, 0.38), (2.5, 0.19), (3.0, 0.10)]
    assert curve_bench.best_of(monotone) == monotone and curve_bench.bits_equiv(0.19, monotone) == (2.5, "")


def test_an_earlier_runs_converter_packs_are_reused_only_for_the_same_model_and_rows(curve_bench, tmp_path):
    rows = torch.arange(12).view(3, 4)
    curve_bench.reuse_converter(tmp_path, "small_model_v4", rows)  # a new --work: the rows are written
    curve_bench.reuse_converter(tmp_path, "small_model_v4", rows.clone())  # the same run again: reused
    for model, other in (("small_model_v4", rows + 1), ("small_model_v4_moe64", rows)):
        with pytest.raises(UserError, match="an earlier run on another model or other calibration rows"):
            curve_bench.reuse_converter(tmp_path, model, other)
    path = tmp_path / curve_bench.CALIBRATION_FILE
    path.write_bytes(path.read_bytes()[:40])  # a run killed while writing it, or a damaged copy
    with pytest.raises(UserError, match="unreadable"):
        curve_bench.reuse_converter(tmp_path, "small_model_v4", rows)


def test_a_work_directory_of_something_else_is_refused(curve_bench, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        curve_bench.main(["--work", str(tmp_path)])
    assert exit_.value.code == 2 and "holds no earlier run of this bench" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_size_between_steps_is_set_against_the_largest_step_below_it(curve_bench):
    steps = [1.5, 1.75, 2.0, 2.25, 2.5]
    assert curve_bench.reference_step(1.6, steps) == 1.5 and curve_bench.reference_step(1.8, steps) == 1.75
    assert curve_bench.reference_step(2.0, steps) == 2.0  # a step is its own reference
