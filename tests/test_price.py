"""The build price `plan` states (orchestrate/price.py): each stage's own estimate at build's defaults, the GPU
to rent from the stages' peaks, the disk at the peak, and whether a Spark's one memory pool holds a stage."""

from __future__ import annotations

import json

import pytest
import torch

from quantizer.calibrate.needs import _block_tensors, _layer_kinds
from quantizer.calibrate.settings import DEFAULT_COLS, DEFAULT_ROWS, CalibrationSettings
from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import load_profile
from quantizer.errors import UserError
from quantizer.model.block import Block
from quantizer.model.targets import classified_layout
from quantizer.orchestrate import price as price_module
from quantizer.orchestrate.price import BuildPrice, Gpu, StagePrice, build_price
from quantizer.plan.uniform import uniform_plan
from quantizer.report import GIB
from quantizer.shipped import model_config_path

V41 = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))


def stage(hours, gpu, ram, disk) -> StagePrice:
    return StagePrice(hours, int(gpu * GIB), int(ram * GIB), int(disk * GIB))


def price(calibrate: StagePrice, quantize: StagePrice, usable_gib: float = 111.6) -> BuildPrice:
    return BuildPrice(calibrate, quantize, hessians=400 * GIB, pack=100 * GIB, tables=50 * GIB,
                      source=500 * GIB, calibrate_gpu="H200",
                      quantize_gpu="H100 80GB HBM3", rent=None, spark_usable=int(usable_gib * GIB))


def test_disk_at_the_peak_is_the_source_with_the_larger_of_the_calibration_and_what_follows_it():
    p = price(stage(1, 100, 20, 600), stage(4, 50, 20, 150))
    assert p.disk == 500 * GIB + max(600, 400 + 150 + 100) * GIB
    p = price(stage(1, 100, 20, 900), stage(4, 50, 20, 150))
    assert p.disk == (500 + 900) * GIB
    assert p.hours == 5


def test_a_spark_is_refused_naming_the_stage_its_one_memory_pool_cannot_hold():
    verdict = price(stage(1, 100, 20, 600), stage(4, 50, 20, 150)).spark_verdict()
    assert verdict.startswith("no: calibrate needs 120.0 GiB of GPU memory and RAM together, a Spark has 111.6 GiB")
    assert "quantize fits (70.0 GiB), but no rate is measured on GB10" in verdict
    held = price(stage(1, 60, 20, 600), stage(4, 50, 20, 150)).spark_verdict()
    assert held.startswith("its memory holds every stage (at most 80.0 of 111.6 GiB)") and "no hours" in held


def test_the_real_model_rents_the_smallest_gpu_that_holds_the_calibration():
    plan = uniform_plan(V41, 2.0, profile=load_profile("vllm-exl3"))
    p = build_price(V41, plan)
    assert p.calibrate.gpu > 80 * GIB > p.quantize.gpu  # the calibration decides the card
    assert p.rent is not None and p.rent.memory >= p.calibrate.gpu
    smaller = [g for g in price_module._build_gpus()[0] if g.memory < p.rent.memory]
    assert all(g.memory < p.calibrate.gpu for g in smaller)
    assert 0.5 < p.calibrate.hours < 1.5  # the measured 82 s a layer, 40 layers at 250 x 2048
    assert p.source == pytest.approx(475.24 * GIB, rel=1e-3)
    lines = "\n".join(p.lines())
    assert f"one {p.rent.name} (" in lines and "no measured rate" in lines  # the pack stage is not timed


def test_no_known_gpu_holding_the_calibration_says_so(monkeypatch):
    gpus, rate = price_module._build_gpus()
    monkeypatch.setattr(price_module, "_build_gpus", lambda: ([Gpu("tiny", 8 * GIB)], rate))
    p = build_price(V41, uniform_plan(V41, 2.0, profile=load_profile("vllm-exl3")))
    assert p.rent is None and "none of the known GPUs holds the calibration" in "\n".join(p.lines())


def test_plan_json_carries_the_price(capsys):
    assert main(["plan", "--model-config", "small-v41", "--bpw", "2.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["price"]) >= {"calibrate", "quantize", "pack_gib", "gpu_hours", "disk_gib", "rent", "spark"}
    assert out["price"]["calibrate"]["gpu"] == "H200"


def test_layers_of_one_kind_build_the_same_block():
    """calibration_needs builds one block per kind of layer (_layer_kinds): every layer's own block holds the same
    tensors, in the same order, as the first layer of its kind (the real model's 40 layers are 6 kinds)."""
    cfg = V41
    layout = {spec.name: spec for spec, _ in classified_layout(cfg)}
    kinds = _layer_kinds(layout, cfg.num_layers)
    assert len(set(kinds)) == 6
    checked = [layer for layer in range(cfg.num_layers) if kinds[layer] != layer][:3]
    for layer in checked:
        with torch.device("meta"):
            own = Block(cfg, layer, CalibrationSettings().dtype)
        assert tuple((k, t.nbytes) for k, t in own.state_dict().items()) == _block_tensors(
            cfg, kinds[layer], CalibrationSettings().dtype)
    assert DEFAULT_ROWS == 250 and DEFAULT_COLS == 2048  # what the price and README's table state


@pytest.mark.parametrize("text", ['{"format": "quantizer-build-gpus", "gpus": [{"name": "H1', '{"gpus": []}',
                                  '{"format": "quantizer-build-gpus", "gpus": [], "calibration": {"gpu": "H200"}}'])
def test_a_truncated_or_wrong_gpu_table_is_one_line(text, tmp_path, monkeypatch):
    path = tmp_path / "build_gpus.json"
    path.write_text(text)
    monkeypatch.setattr(price_module, "shipped", lambda *parts: path)
    with pytest.raises(UserError) as e:
        price_module._build_gpus()
    assert str(e.value).startswith(f"{path}: not a") and "\n" not in str(e.value)
